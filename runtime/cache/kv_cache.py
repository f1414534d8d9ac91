"""The KV cache: per-layer key and value buffers written in place, with exact byte accounting.

Must not import Qt.

Layout: for each layer one K and one V buffer ``(B, Hkv, capacity, D)``; tokens ``0 .. length-1``
are valid. Keys are stored after RoPE (so a decode step reads them as they are).

Why grow in chunks instead of preallocating the whole context: an 8,192-token float32 cache
of the default model is 8192 x 46,080 B = 360 MiB, most of which a short chat never uses, and
the memory panel should show what a conversation really costs. Why not ``torch.cat`` per token:
it copies the whole cache every step (O(T^2) bytes over a reply); growing by ``chunk_tokens``
copies each token at most ``capacity / chunk_tokens`` times.

Sliding-window layers (Mistral, Gemma 2/3, Phi-3): a layer whose queries see only the ``window``
newest keys keeps a bounded buffer with an offset. ``start[i]`` is the absolute position of its
slot 0; it holds positions ``start[i] .. length-1`` and needs at most the last ``window`` of them. When a write would overflow its buffer, the
tokens before ``length - window`` are dropped (the rest moved to the front), so the
buffer stays at about ``window + chunk_tokens`` tokens however long the conversation:
memory per token shrinks to the full-attention layers' share once the window is full.
A bounded buffer (not a ring) keeps keys in position order, so attention and the
attention view read a plain slice, and a crop back a few tokens stays possible as long
as the buffer still holds the window before the crop point (:meth:`KVCache.crop_point`).

The cache owns three parts and keeps this module about which slots hold what: its byte
figures (``bytes``, :class:`runtime.cache.byte_counts.ByteCounts`), how its vectors are stored
(``storage``, float or int8: :mod:`runtime.cache.storage`) and which position each slot holds
after a cache policy evicted some (``slots``, :class:`runtime.cache.slots.SlotMap`: ``length``
stays the conversation's true length, each full layer then holds :meth:`KVCache.held` slots).

Every buffer operation runs under ``torch.inference_mode``; the buffers are normal tensors
(:mod:`runtime.cache.storage` says why).
"""
from __future__ import annotations

from typing import Sequence

import torch

from runtime import device as devices
from runtime.cache.byte_counts import ByteCounts
from runtime.cache.slots import SlotMap
from runtime.cache.storage import storage_for
from runtime.dtypes import (
    QUANTIZED_CACHE_DTYPES,
    dtype_name,
    parse_cache_dtype,
)  # noqa: F401  (re-exported: callers import them from here)
from runtime.errors import CacheLimitError


class KVCache:
    """Per-layer K/V buffers ``(B, Hkv, capacity_i, D)`` with an explicit ``length``.

    Args:
        n_layers, n_kv_heads, head_dim: the model's shape.
        max_tokens: the most tokens the cache may hold (its context capacity).
        dtype: element dtype of the buffers (``torch.int8``: codes plus one float32 scale
            per vector in ``k_scale`` / ``v_scale``, ``(B, Hkv, capacity_i, 1)``).
        device: where the buffers live.
        batch: batch size ``B``.
        limit_bytes: optional cap on the bytes the cache needs (``bytes.at``); ``None`` = no cap.
        chunk_tokens: capacity grows in multiples of this many tokens.
        windows: per layer, the sliding window in tokens or None (full attention);
            default: every layer full.

    Raises:
        ValueError: non-positive sizes, a window list of the wrong length.
        CacheLimitError: ``limit_bytes`` smaller than one token.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
        limit_bytes: int | None = None,
        chunk_tokens: int = 256,
        windows: Sequence[int | None] | None = None,
    ):
        if min(n_layers, n_kv_heads, head_dim, batch, chunk_tokens) <= 0:
            raise ValueError("KV cache sizes must be positive")
        if max_tokens <= 0:
            raise ValueError(f"a KV cache must hold at least one token; got max_tokens={max_tokens}")
        windows = tuple(windows) if windows else (None,) * n_layers
        if len(windows) != n_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must give {n_layers} layers a window of at least 1 token or None; got {windows}")
        self.n_layers, self.n_kv_heads, self.head_dim, self.batch = n_layers, n_kv_heads, head_dim, batch
        # A window as long as the cache is no window.
        self.windows: tuple[int | None, ...] = tuple(None if w is None or w >= max_tokens else int(w) for w in windows)
        self.dtype = parse_cache_dtype(dtype)
        self.device = torch.device(device)
        self.max_tokens = int(max_tokens)
        self.chunk_tokens = int(chunk_tokens)
        self.limit_bytes = None if limit_bytes is None else int(limit_bytes)
        #: The byte figures (:class:`runtime.cache.byte_counts.ByteCounts`).
        self.bytes = ByteCounts(self.windows, batch, n_kv_heads, head_dim, self.dtype)
        if self.limit_bytes is not None and self.limit_bytes < self.bytes_per_token:
            raise CacheLimitError(
                f"the KV-cache limit of {self.limit_bytes} bytes is smaller than one token "
                f"({self.bytes_per_token} bytes); raise the limit"
            )
        #: The most tokens this cache can ever hold (capacity cap and byte limit).
        self.token_limit = self.bytes.token_limit(self.max_tokens, self.limit_bytes)
        #: The buffers, float or int8 (:mod:`runtime.cache.storage`).
        self.storage = storage_for(self.dtype, batch, n_kv_heads, head_dim, self.device)
        # Its per-layer buffers, by name: K and V ``(B, Hkv, capacity_i, D)`` (an int8 cache's
        # codes), an int8 cache's float32 scales ``(B, Hkv, capacity_i, 1)`` (empty otherwise).
        self.k, self.v, self.k_scale, self.v_scale = (self.storage.k, self.storage.v,
                                                      self.storage.k_scale, self.storage.v_scale)
        #: Which position each full layer's slot holds after a cache policy's evictions.
        self.slots = SlotMap(self.windows, batch, n_kv_heads, self.device)
        self.length = 0
        #: Per layer: the absolute position of buffer slot 0 (0 for full-attention layers).
        self.start: list[int] = [0] * n_layers
        self.evictor = None  # observes queries for a cache policy (Evictor.attach sets it)

    # ---- the parts' figures, as callers read them --------------------------------------
    @property
    def quantized(self) -> bool:
        """Whether vectors are stored as int8 codes with a scale each."""
        return self.storage.quantized

    @property
    def evicted(self) -> int:
        """Tokens a cache policy has evicted from each full-attention layer (:meth:`keep`)."""
        return self.slots.evicted

    @property
    def evictions(self) -> list[tuple[int, int, int]]:
        """Each eviction: ``(length then, lowest position evicted, tokens evicted)``."""
        return self.slots.evictions

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes one token takes in one layer (:meth:`ByteCounts.layer_bytes_per_token`)."""
        return self.bytes.layer_bytes_per_token(layer)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer (before any sliding window is full)."""
        return self.bytes.per_token

    def layer_tokens(self, layer: int, length: int | None = None) -> int:
        """Tokens layer ``layer`` needs at ``length`` (default: now, less what a cache policy
        evicted from a full layer): ``min(length, window)`` for a sliding layer."""
        return self.bytes.layer_tokens(layer, self.length if length is None else length,
                                       self.evicted if length is None else 0)

    @property
    def used_bytes(self) -> int:
        """Bytes of the tokens in use (less what a cache policy evicted)."""
        return self.bytes.used(self.length, self.evicted)

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers take: sum over layers of buffer capacity x layer bytes per token."""
        return self.bytes.allocated(self._capacities())

    def layer_types(self) -> list[dict]:
        """Per kind of layer, its figures now (:meth:`ByteCounts.layer_types`)."""
        return self.bytes.layer_types(self.length, self.evicted, self._capacities())

    def stats(self) -> dict:
        """The JSON-ready figures (:meth:`ByteCounts.stats`)."""
        return self.bytes.stats(self.length, self.evicted, self._capacities(), self.limit_bytes)

    def _capacities(self) -> list[int]:
        return [kb.shape[2] for kb in self.k]

    @property
    def capacity(self) -> int:
        """Tokens every full layer's buffer holds (all sliding: the smallest); 0 until every layer has one."""
        if len(self.k) < self.n_layers:
            return 0
        caps = [self.k[i].shape[2] for i in range(self.n_layers) if self.windows[i] is None]
        return min(caps or [kb.shape[2] for kb in self.k])

    def held(self, layer: int) -> int:
        """Slots layer ``layer`` holds: ``length - start[layer]``, less a full layer's evicted ones."""
        return self.length - self.start[layer] - (self.evicted if self.windows[layer] is None else 0)

    @property
    def held_tokens(self) -> int:
        """Tokens every full-attention layer holds (``length - evicted``)."""
        return self.length - self.evicted

    @property
    def fixed_slots(self) -> bool:
        """Whether slot ``j`` of every layer holds position ``j`` in a float buffer that only grows
        (no sliding window, nothing evicted, not int8): what the static decode step writes and reads."""
        return self.dtype.is_floating_point and self.evicted == 0 and all(w is None for w in self.windows)

    @property
    def evicts(self) -> bool:
        """Whether slots and positions may differ (a policy is set or has evicted): the
        static decode step (slot = position) cannot run then."""
        return self.evictor is not None or self.evicted > 0

    # ---- growth ----------------------------------------------------------------------
    def _target(self, layer: int, need: int) -> int:
        """Buffer tokens for layer ``layer`` to take ``need`` slots, grown in chunks."""
        cap = -(-need // self.chunk_tokens) * self.chunk_tokens
        return min(cap, self.token_limit) if self.windows[layer] is None else cap

    @torch.inference_mode()
    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more tokens after ``length`` (grows in chunks; a sliding
        layer first drops what is out of its window).

        Raises:
            CacheLimitError: ``length + n_new`` passes ``max_tokens`` or the byte limit,
                or the grown buffers would not fit the device's free memory (checked
                before allocating; an allocation that fails anyway raises it too).
        """
        need = self.held_tokens + n_new
        if need > self.token_limit:
            why = (f"the KV-cache memory limit ({self.limit_bytes} bytes = {self.token_limit} tokens)"
                   if self.token_limit < self.max_tokens else f"the cache capacity of {self.max_tokens} tokens")
            raise CacheLimitError(f"{need} tokens would pass {why}; shorten the conversation or raise the limit")
        for i, w in enumerate(self.windows):
            if w is not None and i < len(self.k) and self.held(i) + n_new > self.k[i].shape[2]:
                self._drop_before(i, max(self.start[i], self.length - w))
        grow = {}
        for i in range(self.n_layers):
            slots = self.held(i) + n_new
            have = self.k[i].shape[2] if i < len(self.k) else 0
            if slots > have or i >= len(self.k):
                grow[i] = self._target(i, slots)
        if not grow:
            return
        need_bytes, new_bytes = self.bytes.growth(grow, self._capacities())
        free = devices.free_memory_bytes(self.device)
        if free is not None and need_bytes > free:
            raise CacheLimitError(
                f"a {max(grow.values())}-token KV cache needs {need_bytes / 2**20:,.1f} MiB more but {self.device} has "
                f"{free / 2**20:,.1f} MiB free; lower the context length or use a smaller cache dtype"
            )
        for i in sorted(grow):
            n = self.held(i)
            try:
                self.storage.resize(i, grow[i], n)
            except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError: CPU allocator
                # Layers grown before this one keep their bigger buffers: only the slots
                # in use are read, so the cache stays consistent.
                raise CacheLimitError(
                    f"out of memory allocating a {grow[i]}-token KV cache "
                    f"({new_bytes} bytes); lower the context length or use a smaller cache dtype"
                ) from e
            self.slots.resize(i, grow[i], n)

    def _drop_before(self, layer: int, pos: int) -> None:
        """Sliding layer: forget positions before ``pos``, moving the rest to slot 0."""
        drop = pos - self.start[layer]
        if drop <= 0:
            return
        self.storage.move(layer, drop, 0, self.length - pos)
        self.start[layer] = pos

    # ---- writes and reads ------------------------------------------------------------
    @torch.inference_mode()
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``(B, Hkv, Tnew, D)`` at ``length`` for one layer (between
        :meth:`reserve` for ``Tnew`` and one :meth:`advance` after the last layer).

        Returns:
            views of the layer's keys and values for positions ``start[layer] ..
            length + Tnew - 1``, ``(B, Hkv, length + Tnew - start[layer], D)``: every
            position for a full layer, at least the window for a sliding one. The new
            tokens are the last ``Tnew``.
        """
        t0 = self.held(layer)
        self.slots.write(layer, t0, self.length, k.shape[2])
        return self.storage.write(layer, t0, k, v)

    @torch.inference_mode()
    def transform_keys(self, layer: int, a: int, b: int, fn) -> None:
        """Replace the keys in buffer slots ``a .. b-1`` of ``layer`` by ``fn(float32 keys (B, Hkv,
        b - a, D))``, stored in the cache's dtype (requantized for int8): the re-rotation after a
        :meth:`remove_span` (:meth:`runtime.model.decoder.Decoder.shift_key_positions`)."""
        self.storage.transform_keys(layer, a, b, fn)

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's keys/values ``(B, Hkv, 1, D)`` at slot ``pos`` (a ``(1,)``
        int64 tensor on the cache's device) of one layer: the static decode step's write,
        whose shapes and addresses do not depend on the position.

        Between :meth:`reserve` and :meth:`advance`; not in inference mode (it runs inside a
        compiled step). Returns the layer's ``capacity`` slots, ``(B, Hkv, capacity, D)``.

        Raises:
            ValueError: a quantized cache (the static step runs it eagerly instead).
        """
        return self.storage.write_at(layer, pos, self.capacity, k, v)

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as valid (after every layer has written them)."""
        if any(self.held(i) + n > self.k[i].shape[2] for i in range(len(self.k))) or len(self.k) < self.n_layers:
            raise CacheLimitError("advance past the reserved capacity (call reserve first)")
        self.length += n

    def read_keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys ``(B, Hkv, held, D)`` as float32 (an int8 cache's dequantized)."""
        return self.storage.read_keys(layer, self.held(layer))

    # ---- slots and positions (the slot map's, at this cache's length) ------------------
    def full_layers(self) -> list[int]:
        """The layers a policy may evict from (no sliding window)."""
        return list(self.slots.full)

    def positions(self, layer: int, n_new: int = 0) -> torch.Tensor:
        """The true position of each slot layer ``layer`` holds, ``(B, Hkv, held + n_new)``
        int64, ascending per head; ``n_new`` counts slots written by :meth:`update` but not
        yet advanced over (they hold ``length .. length + n_new - 1``)."""
        return self.slots.positions(layer, self.start[layer], self.held(layer) + n_new)

    def spread(self, layer: int, weights: torch.Tensor, n_new: int) -> torch.Tensor:
        """Attention weights over layer ``layer``'s slots ``(B, H, Tq, Tk)``, ``n_new`` of them
        written but not yet advanced over, -> over the positions ``0 .. length + n_new - 1``,
        ``(B, H, Tq, length + n_new)``: 0 for a position the layer no longer holds."""
        return self.slots.spread(layer, weights, self.start[layer], self.length + n_new)

    def held_mask(self, layer: int) -> torch.Tensor:
        """``(B, Hkv, length)`` bool: True where layer ``layer``'s head still holds the position
        (a sliding layer: its window's positions)."""
        return self.slots.held_mask(layer, self.start[layer], self.held(layer), self.length)

    @torch.inference_mode()
    def keep(self, slots: dict[int, torch.Tensor]) -> int:
        """Keep only ``slots`` (per full layer ``(B, Hkv, n)`` int64 slot indices, ascending) of
        every full-attention layer, in place; returns the tokens evicted from each.

        Raises:
            ValueError: as :meth:`runtime.cache.slots.SlotMap.keep`.
        """
        held = self.held_tokens
        gone = self.slots.keep(slots, length=self.length, capacity=self._capacities())
        if gone:
            for i, idx in slots.items():
                self.storage.gather(i, idx, held)
        return gone

    # ---- editing ---------------------------------------------------------------------
    def crop_point(self, n: int) -> int:
        """The largest ``m <= n`` that :meth:`crop` can keep exactly: ``n`` when every
        sliding layer still holds the ``window - 1`` tokens before ``n`` (the next
        token's view), else 0 (the conversation must be prefilled again). After
        evictions by a policy: the latest point at or before ``n`` whose cache no later
        eviction has touched (:meth:`restorable`), so what was evicted is never taken
        for reused."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop point {n} outside 0..{self.length}")
        n = self.slots.restorable(n)
        for i, w in enumerate(self.windows):
            if w is not None and self.start[i] > max(0, n - w + 1):
                return 0
        return n

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` tokens (``0 <= n <= length``); memory stays allocated.

        Raises:
            ValueError: ``n`` outside ``0 .. length``, or a sliding layer that no longer
                holds the window before ``n`` (ask :meth:`crop_point` first).
        """
        if self.crop_point(n) != n:  # crop_point refuses an n outside 0..length
            raise ValueError(
                f"crop({n}): the sliding-window layers no longer hold the tokens before {n}; crop to 0 and prefill again"
            )
        self.slots.crop(n)
        self.length = n
        for i in range(self.n_layers):
            self.start[i] = min(self.start[i], n)
        if self.evictor is not None:
            self.evictor.cropped(self)

    @torch.inference_mode()
    def remove_span(self, start: int, end: int) -> None:
        """Remove positions ``start .. end-1``, renumbering later tokens down (in place).

        The rolling overflow policy's cut (:func:`runtime.cache.policies.sinks_window.rolling_span`);
        the caller re-rotates the shifted keys' positions (see
        ``runtime.model.decoder.Decoder.shift_key_positions``). A sliding layer that holds none
        of the removed tokens only relabels its positions. A cache policy's eviction
        (:meth:`keep`) keeps positions instead; a cache does one or the other.
        """
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"remove_span({start}, {end}) outside 0..{self.length}")
        if self.evicted:
            raise ValueError("remove_span(): this cache's slots are not its positions (a policy evicted tokens); "
                             "use keep()")
        n_removed = end - start
        for i in range(len(self.k)):
            s = self.start[i]
            if s >= end:
                self.start[i] = s - n_removed
                continue
            lo = max(start, s) - s  # first removed slot
            hi = end - s  # first kept slot after the removed ones
            self.storage.move(i, hi, lo, self.length - end)
            self.start[i] = min(s, start)
        self.length -= n_removed

    def slot_range(self, layer: int, start: int, end: int) -> tuple[int, int]:
        """Buffer slots ``(a, b)`` of layer ``layer`` holding positions ``start .. end-1``
        (clipped to what the layer holds; ``a == b`` when none)."""
        s = self.start[layer]
        a, b = max(start, s) - s, max(min(end, self.length), s) - s
        return a, max(a, b)

    def reset(self) -> None:
        """Forget every token (``length = 0``); memory stays allocated."""
        self.length = 0
        self.start = [0] * self.n_layers
        self.slots.clear()
        if self.evictor is not None:
            self.evictor.cropped(self)

    @torch.inference_mode()
    def shrink_to_fit(self, room: int = 0, layers: Sequence[int] | None = None) -> int:
        """Reallocate the buffers of ``layers`` (default all; :meth:`release` when all and ``length``
        is 0) at the smallest chunk multiple holding :meth:`held` + ``room`` tokens; nothing is
        dropped. For an idle cache (a pooled server session) or after a policy's eviction, whose
        buffers otherwise stay at their peak. Returns the bytes freed."""
        before = self.allocated_bytes
        if self.length == 0 and layers is None:
            self.release()
            return before
        for i in range(len(self.k)) if layers is None else layers:
            if i >= len(self.k):
                continue
            held = self.held(i)
            cap = self._target(i, max(held + room, 1))
            if cap >= self.k[i].shape[2]:
                continue
            self.storage.resize(i, cap, held)
            self.slots.resize(i, cap, held)
        return before - self.allocated_bytes

    def release(self) -> None:
        """Free the buffers (``length = capacity = 0``)."""
        self.storage.clear()
        self.reset()

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.n_layers}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"length={self.length}, capacity={self.capacity}, dtype={dtype_name(self.dtype)})")
