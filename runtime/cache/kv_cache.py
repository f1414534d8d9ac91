"""The KV cache: per-layer key and value buffers written in place, with exact byte accounting.

Must not import Qt.

Layout: for each layer one K and one V buffer ``(B, Hkv, capacity, D)``; tokens
``0 .. length-1`` are valid. Keys are stored after RoPE (so a decode step reads them
as they are).

Why grow in chunks instead of preallocating the whole context: an 8,192-token
float32 cache of the default model is 8192 x 46,080 B = 360 MiB, most of which a
short chat never uses, and the memory panel should show what a conversation really
costs. Why not ``torch.cat`` per token: that copies the whole cache every step
(O(T^2) bytes over a reply). Growing by ``chunk_tokens`` copies each token at most
``capacity / chunk_tokens`` times and keeps every decode step an in-place write.

Sliding-window layers (Mistral, Gemma 2/3, Phi-3): a layer whose queries see only the
``window`` newest keys keeps a bounded buffer with an offset. ``start[i]`` is the
absolute position of its slot 0; it holds positions ``start[i] .. length-1`` and needs
at most the last ``window`` of them. When a write would overflow its buffer, the
tokens before ``length - window`` are dropped (the rest moved to the front), so the
buffer stays at about ``window + chunk_tokens`` tokens however long the conversation:
memory per token shrinks to the full-attention layers' share once the window is full.
A bounded buffer (not a ring) keeps keys in position order, so attention and the
attention view read a plain slice, and a crop back a few tokens stays possible as long
as the buffer still holds the window before the crop point (:meth:`KVCache.crop_point`).

Three mixins keep this module about the buffers: the byte figures
(:mod:`runtime.cache.accounting`), an int8 cache's storage (:mod:`runtime.cache.kv_quant`)
and the slots a policy evicted (:mod:`runtime.cache.kv_evict`: ``length`` stays the
conversation's true length, each full layer then holds :meth:`KVCache.held` slots).

Every buffer operation runs under ``torch.inference_mode``; the buffers themselves are
normal tensors (no autograd history, writable from any caller), since a compiled decode
step cannot write into views of inference tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch

from runtime import device as devices
from runtime.cache.accounting import ByteAccounting
from runtime.cache.kv_evict import EvictedSlots
from runtime.cache.kv_quant import QuantizedStorage
from runtime.dtypes import (
    QUANTIZED_CACHE_DTYPES,
    dtype_name,
    parse_cache_dtype,
)  # noqa: F401  (re-exported: callers import them from here)
from runtime.errors import CacheLimitError


class KVCache(ByteAccounting, QuantizedStorage, EvictedSlots):
    """Per-layer K/V buffers ``(B, Hkv, capacity_i, D)`` with an explicit ``length``.

    Args:
        n_layers, n_kv_heads, head_dim: the model's shape.
        max_tokens: the most tokens the cache may hold (its context capacity).
        dtype: element dtype of the buffers (``torch.int8``: codes plus one float32 scale
            per vector in ``k_scale`` / ``v_scale``, ``(B, Hkv, capacity_i, 1)``).
        device: where the buffers live.
        batch: batch size ``B``.
        limit_bytes: optional cap on the bytes the cache needs (:meth:`bytes_at`); ``None`` = no cap.
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
        if self.limit_bytes is not None and self.limit_bytes < self.bytes_per_token:
            raise CacheLimitError(
                f"the KV-cache limit of {self.limit_bytes} bytes is smaller than one token "
                f"({self.bytes_per_token} bytes); raise the limit"
            )
        self.length = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # quantized dtypes only
        self.v_scale: list[torch.Tensor] = []
        #: Per layer: the absolute position of buffer slot 0 (0 for full-attention layers).
        self.start: list[int] = [0] * n_layers
        #: Tokens a policy has evicted from each full-attention layer (:meth:`keep`).
        self.evicted = 0
        #: Per full layer after an eviction: each slot's true position, ``(B, Hkv, capacity_i)``
        #: int64 (None: slot ``j`` holds position ``j``).
        self.pos: list[torch.Tensor | None] = [None] * n_layers
        #: Each eviction as ``(length then, lowest position evicted, tokens evicted)``.
        self.evictions: list[tuple[int, int, int]] = []
        #: Observes queries for the eviction policy (:class:`runtime.cache.evictor.Evictor`
        #: sets itself here); None: no policy.
        self.evictor = None
        # Dequantized keys and values of the layer being read (quantized dtypes only): one
        # layer's worth, reused by every layer, in the dtype the model computes in.
        self._read_k: torch.Tensor | None = None
        self._read_v: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        """Whether vectors are stored as int8 codes with a scale each."""
        return self.dtype in QUANTIZED_CACHE_DTYPES

    @property
    def capacity(self) -> int:
        """Tokens every full-attention layer's buffer holds (all sliding: the smallest
        buffer); 0 until every layer has one."""
        if len(self.k) < self.n_layers:
            return 0
        caps = [self.k[i].shape[2] for i in range(self.n_layers) if self.windows[i] is None]
        return min(caps or [kb.shape[2] for kb in self.k])

    def held(self, layer: int) -> int:
        """Slots layer ``layer`` holds: ``length - start[layer]``, less what a policy evicted
        from a full-attention layer."""
        return self.length - self.start[layer] - (self.evicted if self.windows[layer] is None else 0)

    @property
    def held_tokens(self) -> int:
        """Tokens every full-attention layer holds (``length - evicted``)."""
        return self.length - self.evicted

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
            why = (
                f"the KV-cache memory limit ({self.limit_bytes} bytes = {self.token_limit} tokens)"
                if self.token_limit < self.max_tokens
                else f"the cache capacity of {self.max_tokens} tokens"
            )
            raise CacheLimitError(
                f"{need} tokens would pass {why}; shorten the conversation or raise the limit"
            )
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
        # Layer by layer, the new K and V buffers exist next to that layer's old ones while
        # its tokens are copied over: the growth plus one layer's old buffers at the peak
        # (all layers at once would briefly double the cache).
        old = {i: (self.k[i].shape[2] if i < len(self.k) else 0) for i in grow}
        need_bytes = sum((cap - old[i]) * self.layer_bytes_per_token(i) for i, cap in grow.items())
        need_bytes += max(old[i] * self.layer_bytes_per_token(i) for i in grow)
        new_bytes = sum(cap * self.layer_bytes_per_token(i) for i, cap in grow.items())
        free = devices.free_memory_bytes(self.device)
        if free is not None and need_bytes > free:
            raise CacheLimitError(
                f"a {max(grow.values())}-token KV cache needs {need_bytes / 2**20:,.1f} MiB more but {self.device} has "
                f"{free / 2**20:,.1f} MiB free; lower the context length or use a smaller cache dtype"
            )
        for i in sorted(grow):
            try:
                new = [self._zeros(grow[i], scale) for scale in (False, False, True, True)[: len(self._planes())]]
            except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError: CPU allocator
                # Layers grown before this one keep their bigger buffers: only the slots
                # in use are read, so the cache stays consistent.
                raise CacheLimitError(
                    f"out of memory allocating a {grow[i]}-token KV cache "
                    f"({new_bytes} bytes); lower the context length or use a smaller cache dtype"
                ) from e
            n = self.held(i)
            for plane, buf in zip(self._planes(), new):
                if i < len(plane):
                    buf[:, :, :n].copy_(plane[i][:, :, :n])
                    plane[i] = buf
                else:
                    plane.append(buf)
            if self.pos[i] is not None:
                self.pos[i] = _resized(self.pos[i], grow[i], n)
        self._read_k = self._read_v = None  # re-made at the new size on the next read

    def _planes(self) -> tuple[list[torch.Tensor], ...]:
        """The per-layer buffer lists: K and V, then their scales when quantized."""
        return (self.k, self.v, self.k_scale, self.v_scale) if self.quantized else (self.k, self.v)

    def _zeros(self, tokens: int, scale: bool) -> torch.Tensor:
        """A zeroed ``(B, Hkv, tokens, D)`` buffer, or ``(B, Hkv, tokens, 1)`` float32 scales: a
        normal tensor (see the module). Zero-filled: the static decode step attends over the
        whole buffer and masks the unused slots, and a masked NaN still poisons (0 x NaN)."""
        shape = (self.batch, self.n_kv_heads, tokens, 1 if scale else self.head_dim)
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=torch.float32 if scale else self.dtype, device=self.device)

    def _drop_before(self, layer: int, pos: int) -> None:
        """Sliding layer: forget positions before ``pos``, moving the rest to slot 0."""
        drop = pos - self.start[layer]
        if drop <= 0:
            return
        n = self.length - pos
        for buf in (plane[layer] for plane in self._planes()):
            # clone: source and destination overlap.
            buf[:, :, :n].copy_(buf[:, :, drop : drop + n].clone())
        self.start[layer] = pos

    @torch.inference_mode()
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``(B, Hkv, Tnew, D)`` at ``length`` for one layer.

        The caller must have called :meth:`reserve` for ``Tnew`` and calls
        :meth:`advance` once after the last layer.

        Returns:
            views of the layer's keys and values for positions ``start[layer] ..
            length + Tnew - 1``, ``(B, Hkv, length + Tnew - start[layer], D)``: every
            position for a full layer, at least the window for a sliding one. The new
            tokens are the last ``Tnew``.
        """
        t0 = self.held(layer)
        t1 = t0 + k.shape[2]
        if self.pos[layer] is not None:
            self.pos[layer][:, :, t0:t1] = torch.arange(self.length, self.length + k.shape[2], device=self.device)
        if self.quantized:
            self._store(layer, t0, k, v)
            return self._read(layer, t1, k.dtype)
        kb, vb = self.k[layer], self.v[layer]
        kb[:, :, t0:t1].copy_(k)
        vb[:, :, t0:t1].copy_(v)
        return kb[:, :, :t1], vb[:, :, :t1]

    @torch.inference_mode()
    def transform_keys(self, layer: int, a: int, b: int, fn) -> None:
        """Replace the keys in buffer slots ``a .. b-1`` of ``layer`` by ``fn(keys)`` (in place).

        ``fn`` takes and returns float32 ``(B, Hkv, b - a, D)``; the result is stored in
        the cache's dtype (requantized for an int8 cache). Used to re-rotate keys after an
        eviction (:meth:`runtime.model.decoder.Decoder.shift_key_positions`).
        """
        if self.quantized:
            self._transform_quantized(layer, a, b, fn)
        else:
            kb = self.k[layer]
            kb[:, :, a:b] = fn(kb[:, :, a:b].float()).to(kb.dtype)

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token's keys/values ``(B, Hkv, 1, D)`` at slot ``pos`` (a ``(1,)``
        int64 tensor on the cache's device) of one layer: the static decode step's write,
        whose shapes and addresses do not depend on the position.

        The caller must have called :meth:`reserve` and calls :meth:`advance` after. Not
        wrapped in inference mode (unlike the other writes): it runs inside a compiled step.

        Returns:
            all ``capacity`` slots of that layer's keys and values, ``(B, Hkv, capacity, D)``.

        Raises:
            ValueError: a quantized cache (the static step runs it eagerly instead).
        """
        if self.quantized:
            raise ValueError(f"write_at: a {dtype_name(self.dtype)} cache is written by update(), not by the static step")
        kb, vb = self.k[layer][:, :, : self.capacity], self.v[layer][:, :, : self.capacity]
        kb.index_copy_(2, pos, k.to(kb.dtype))
        vb.index_copy_(2, pos, v.to(vb.dtype))
        return kb, vb

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as valid (after every layer has written them)."""
        if any(self.held(i) + n > self.k[i].shape[2] for i in range(len(self.k))) or len(self.k) < self.n_layers:
            raise CacheLimitError("advance past the reserved capacity (call reserve first)")
        self.length += n

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
        n = self.restorable(n)
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
        self._crop_evictions(n)
        self.length = n
        for i in range(self.n_layers):
            self.start[i] = min(self.start[i], n)
        if self.evictor is not None:
            self.evictor.cropped(self)

    @torch.inference_mode()
    def evict(self, start: int, end: int) -> None:
        """Remove tokens ``start .. end-1``, shifting later tokens down (in place).

        Used by the rolling context policy; the caller re-rotates the shifted keys'
        positions (see ``runtime.model.decoder.Decoder.shift_key_positions``). A sliding layer
        that holds none of the evicted tokens only relabels its positions.
        """
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"evict({start}, {end}) outside 0..{self.length}")
        if self.evicted:
            raise ValueError("evict(): this cache's slots are not its positions (a policy evicted tokens); use keep()")
        n_evict = end - start
        for i in range(len(self.k)):
            s = self.start[i]
            if s >= end:
                self.start[i] = s - n_evict
                continue
            lo = max(start, s) - s  # first evicted slot
            hi = end - s  # first kept slot after the evicted ones
            n_shift = self.length - end
            for buf in (plane[i] for plane in self._planes()):
                # clone: source and destination overlap.
                buf[:, :, lo : lo + n_shift].copy_(buf[:, :, hi : hi + n_shift].clone())
            self.start[i] = min(s, start)
        self.length -= n_evict

    def slots(self, layer: int, start: int, end: int) -> tuple[int, int]:
        """Buffer slots ``(a, b)`` of layer ``layer`` holding positions ``start .. end-1``
        (clipped to what the layer holds; ``a == b`` when none)."""
        s = self.start[layer]
        a, b = max(start, s) - s, max(min(end, self.length), s) - s
        return a, max(a, b)

    def reset(self) -> None:
        """Forget every token (``length = 0``); memory stays allocated."""
        self.length = 0
        self.start = [0] * self.n_layers
        self._forget_evictions()

    @torch.inference_mode()
    def shrink_to_fit(self) -> int:
        """Reallocate each layer's buffers at the smallest chunk multiple that holds the
        tokens it holds now (:meth:`held`; :meth:`release` when ``length`` is 0);
        nothing is dropped, so reads, :meth:`crop_point` and the next :meth:`reserve` act
        as before. For an idle cache (a pooled server session): a long reply's buffers
        otherwise stay at their peak.

        Returns:
            the bytes freed (:attr:`allocated_bytes` before minus after).
        """
        before = self.allocated_bytes
        if self.length == 0:
            self.release()
            return before
        for i in range(len(self.k)):
            held = self.held(i)
            cap = self._target(i, max(held, 1))
            if cap >= self.k[i].shape[2]:
                continue
            for plane in (*self._planes(), self.pos):
                if plane[i] is not None:
                    plane[i] = _resized(plane[i], cap, held)
        self._read_k = self._read_v = None  # sized for the largest layer: re-made on the next read
        return before - self.allocated_bytes

    def release(self) -> None:
        """Free the buffers (``length = capacity = 0``)."""
        self.k, self.v, self.k_scale, self.v_scale = [], [], [], []
        self._read_k = self._read_v = None
        self.reset()

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.n_layers}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"length={self.length}, capacity={self.capacity}, dtype={dtype_name(self.dtype)})"
        )


def _resized(buf: torch.Tensor, tokens: int, n: int) -> torch.Tensor:
    """``buf`` ``(B, Hkv, slots, ...)`` reallocated at ``tokens`` slots (zeroed; a normal tensor,
    see the module), its first ``n`` slots copied over."""
    with torch.inference_mode(False):
        out = torch.zeros((*buf.shape[:2], tokens, *buf.shape[3:]), dtype=buf.dtype, device=buf.device)
    out[:, :, :n].copy_(buf[:, :, :n])
    return out
