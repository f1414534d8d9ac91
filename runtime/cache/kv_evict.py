"""The KV cache's evicted slots: which positions each full-attention layer still holds, and
dropping the rest (:class:`runtime.cache.kv_cache.KVCache`).

Must not import Qt. Its own module to keep ``kv_cache.py`` about buffers: these methods
run on a :class:`~runtime.cache.kv_cache.KVCache` (its attributes below). A policy
(:mod:`runtime.cache.eviction`) chooses the slots; :meth:`EvictedSlots.keep` gathers them
in place, per KV head, in every plane (keys, values, an int8 cache's scales, positions).

Keys stay as they were cached: rotated at their own positions. A query at position ``p``
rotated at ``p`` then sees the same ``q . k`` as in a full cache (RoPE scores depend on
``p - p_k`` only), so no re-rotation is needed, and the conversation keeps its true
positions (``length``): each full layer then holds ``length - evicted`` slots
(:meth:`KVCache.held`) whose positions are in ``pos``. Sliding layers are never evicted by a
policy (their window already bounds them, and their attention masks by slot distance).
The ``rolling`` overflow policy instead renumbers positions
(:meth:`KVCache.evict` plus a re-rotation); a cache does one or the other.

Which crop points are exact after evictions: eviction ``e`` ran when the cache was
``L_e`` long and dropped positions ``>= m_e``. The cache as it was at length ``t`` is
still there (the slots with position ``< t``) when no eviction after ``t`` dropped a
position before ``t``: ``L_e <= t`` or ``m_e >= t`` for every ``e``
(:meth:`EvictedSlots.restorable`).
"""
from __future__ import annotations

import torch

from runtime.quantize import dequantize_int8


class EvictedSlots:
    """Mixin of :class:`runtime.cache.kv_cache.KVCache`: positions of the slots, and eviction."""

    n_layers: int
    n_kv_heads: int
    batch: int
    length: int
    evicted: int
    windows: tuple[int | None, ...]
    start: list[int]
    pos: list[torch.Tensor | None]
    evictions: list[tuple[int, int, int]]
    k: list[torch.Tensor]
    device: torch.device
    evictor: object

    def full_layers(self) -> list[int]:
        """The layers a policy may evict from (no sliding window)."""
        return [i for i, w in enumerate(self.windows) if w is None]

    def positions(self, layer: int, n_new: int = 0) -> torch.Tensor:
        """The true position of each slot layer ``layer`` holds, ``(B, Hkv, held + n_new)``
        int64, ascending per head; ``n_new`` counts slots written by :meth:`update` but not
        yet advanced over (they hold ``length .. length + n_new - 1``)."""
        n = self.held(layer) + n_new
        if self.pos[layer] is not None:
            return self.pos[layer][:, :, :n]
        first = self.start[layer]
        return torch.arange(first, first + n, device=self.device).expand(self.batch, self.n_kv_heads, n)

    def spread(self, layer: int, weights: torch.Tensor, n_new: int) -> torch.Tensor:
        """Attention weights over layer ``layer``'s slots ``(B, H, Tq, Tk)``, ``n_new`` of them
        written but not yet advanced over, -> over the positions ``0 .. length + n_new - 1``,
        ``(B, H, Tq, length + n_new)``: 0 for a position the layer no longer holds."""
        B, H, Tq, Tk = weights.shape
        total = self.length + n_new
        if self.pos[layer] is None:  # contiguous from start[layer]
            return torch.nn.functional.pad(weights, (total - Tk, 0))
        idx = self.positions(layer, n_new)  # (B, Hkv, Tk)
        idx = idx.repeat_interleave(H // idx.shape[1], dim=1).unsqueeze(2).expand(B, H, Tq, Tk)
        return weights.new_zeros(B, H, Tq, total).scatter_(-1, idx, weights)

    def held_mask(self, layer: int) -> torch.Tensor:
        """``(B, Hkv, length)`` bool: True where layer ``layer``'s head still holds the position
        (a sliding layer: its window's positions)."""
        mask = torch.zeros((self.batch, self.n_kv_heads, self.length), dtype=torch.bool, device=self.device)
        return mask.scatter_(-1, self.positions(layer), True)

    @torch.inference_mode()
    def keep(self, slots: dict[int, torch.Tensor]) -> int:
        """Keep only the given slots of every full-attention layer; drop the others (in place).

        Args:
            slots: for each full layer, ``(B, Hkv, n)`` int64 slot indices, ascending per
                head, the same ``n`` for every layer.

        Returns:
            tokens evicted from each full layer (``held - n``); added to :attr:`evicted`.

        Raises:
            ValueError: a layer missing or sliding, differing ``n``, indices out of range.
        """
        full = self.full_layers()
        if sorted(slots) != full:
            raise ValueError(f"keep() needs slots for the full-attention layers {full}; got {sorted(slots)}")
        sizes = {s.shape[-1] for s in slots.values()}
        held = self.held_tokens
        if len(sizes) != 1 or not 0 < min(sizes) <= held:
            raise ValueError(f"keep(): every layer must keep the same number of slots (1..{held}); got {sorted(sizes)}")
        n = sizes.pop()
        if n == held:
            return 0
        lowest = self.length
        for i, idx in slots.items():
            if idx.shape[:2] != (self.batch, self.n_kv_heads) or int(idx.min()) < 0 or int(idx.max()) >= held:
                raise ValueError(f"keep(): layer {i}'s slots must be (B, Hkv, n) indices in 0..{held - 1}")
            pos = self.positions(i)  # (B, Hkv, held)
            gone = torch.ones_like(pos, dtype=torch.bool).scatter_(-1, idx, False)
            if bool(gone.any()):
                lowest = min(lowest, int(pos[gone].min()))
            if self.pos[i] is None:
                with torch.inference_mode(False):
                    self.pos[i] = torch.zeros((self.batch, self.n_kv_heads, self.k[i].shape[2]), dtype=torch.long,
                                              device=self.device)
                self.pos[i][:, :, :held].copy_(pos)
            for buf in (*(plane[i] for plane in self._planes()), self.pos[i]):
                view = idx if buf.dim() == 3 else idx.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])
                buf[:, :, :n].copy_(buf[:, :, :held].gather(2, view))
        self.evicted += held - n
        self.evictions.append((self.length, lowest, held - n))
        self._read_k = self._read_v = None
        return held - n

    def restorable(self, n: int) -> int:
        """The latest length ``t <= n`` whose cache the slots still hold exactly (see the module)."""
        t = n
        changed = True
        while changed:
            changed = False
            for length, lowest, _ in self.evictions:
                if length > t and lowest < t:
                    t, changed = lowest, True
        return t

    def _crop_evictions(self, n: int) -> None:
        """Forget the evictions after length ``n`` (they dropped positions ``>= n`` only:
        the caller checked :meth:`restorable`) and count the rest."""
        self.evictions = [e for e in self.evictions if e[0] <= n]
        self.evicted = sum(e[2] for e in self.evictions)

    def _forget_evictions(self) -> None:
        self.evicted = 0
        self.evictions = []
        self.pos = [None] * self.n_layers
        if self.evictor is not None:
            self.evictor.cropped(self)

    def read_keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys ``(B, Hkv, held, D)`` as float32 (an int8 cache's dequantized)."""
        n = self.held(layer)
        if self.quantized:
            return dequantize_int8(self.k[layer][:, :, :n], self.k_scale[layer][:, :, :n])
        return self.k[layer][:, :, :n].float()
