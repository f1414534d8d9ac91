"""Which position each slot of the KV cache holds after a cache policy evicted some: the slot map.

Must not import Qt. A :class:`runtime.cache.kv_cache.KVCache` owns one (its ``slots``), as
llama.cpp's cache owns its cells (``llama-kv-cells.h``): the bookkeeping of positions is an
object, not a base class. A policy (:mod:`runtime.cache.policies`) chooses the slots to keep;
:meth:`SlotMap.keep` records the choice and gathers the positions, and the cache gathers its
buffers (:meth:`runtime.cache.storage.FloatStorage.gather`) with the same indices.

Keys stay as they were cached: rotated at their own positions. A query at position ``p``
rotated at ``p`` then sees the same ``q . k`` as in a full cache (RoPE scores depend on
``p - p_k`` only), so no re-rotation is needed, and the conversation keeps its true
positions (the cache's ``length``): each full layer then holds ``length - evicted`` slots
whose positions are in ``pos``. Sliding layers are never evicted by a policy (their window
already bounds them, and their attention masks by slot distance). The ``rolling`` overflow
policy instead renumbers positions (:meth:`KVCache.remove_span` plus a re-rotation); a
cache does one or the other.

Which crop points are exact after evictions: eviction ``e`` ran when the cache was ``L_e``
long and dropped positions ``>= m_e``. The cache as it was at length ``t`` is still there
(the slots with position ``< t``) when no eviction after ``t`` dropped a position before
``t``: ``L_e <= t`` or ``m_e >= t`` for every ``e`` (:meth:`SlotMap.restorable`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class SlotMap:
    """The true position of each slot of the full-attention layers, and the evictions so far.

    Args:
        windows: per layer its sliding window or None (full attention: the layers a policy evicts from).
        batch, n_kv_heads: the cache's ``B`` and ``Hkv``; device: where the positions live.
    """

    def __init__(self, windows: Sequence[int | None], batch: int, n_kv_heads: int, device: torch.device):
        self.batch, self.n_kv_heads, self.device = batch, n_kv_heads, device
        #: The layers a policy may evict from (no sliding window).
        self.full: list[int] = [i for i, w in enumerate(windows) if w is None]
        #: Tokens a policy has evicted from each full-attention layer.
        self.evicted = 0
        #: Each eviction as ``(length then, lowest position evicted, tokens evicted)``.
        self.evictions: list[tuple[int, int, int]] = []
        # Per layer after an eviction: each slot's true position, (B, Hkv, capacity_i) int64
        # (None: slot j holds position first + j).
        self._pos: list[torch.Tensor | None] = [None] * len(windows)

    # ---- reading ------------------------------------------------------------------------
    def positions(self, layer: int, first: int, n: int) -> torch.Tensor:
        """The true position of the layer's first ``n`` slots, ``(B, Hkv, n)`` int64, ascending
        per head (``first``: the position of slot 0 while the slots are contiguous)."""
        if self._pos[layer] is not None:
            return self._pos[layer][:, :, :n]
        return torch.arange(first, first + n, device=self.device).expand(self.batch, self.n_kv_heads, n)

    def mapped(self, layer: int) -> bool:
        """Whether layer ``layer``'s slots have left position order (an eviction gathered them)."""
        return self._pos[layer] is not None

    def spread(self, layer: int, weights: torch.Tensor, first: int, total: int) -> torch.Tensor:
        """Attention weights over the layer's slots ``(B, H, Tq, Tk)`` -> over the positions
        ``0 .. total - 1``, ``(B, H, Tq, total)``: 0 for a position the layer no longer holds."""
        B, H, Tq, Tk = weights.shape
        if self._pos[layer] is None:  # contiguous from first
            return torch.nn.functional.pad(weights, (total - Tk, 0))
        idx = self.positions(layer, first, Tk)  # (B, Hkv, Tk)
        idx = idx.repeat_interleave(H // idx.shape[1], dim=1).unsqueeze(2).expand(B, H, Tq, Tk)
        return weights.new_zeros(B, H, Tq, total).scatter_(-1, idx, weights)

    def held_mask(self, layer: int, first: int, n: int, length: int) -> torch.Tensor:
        """``(B, Hkv, length)`` bool: True where the layer's head holds the position (its first ``n`` slots)."""
        mask = torch.zeros((self.batch, self.n_kv_heads, length), dtype=torch.bool, device=self.device)
        return mask.scatter_(-1, self.positions(layer, first, n), True)

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

    # ---- writing ------------------------------------------------------------------------
    def write(self, layer: int, t0: int, length: int, n_new: int) -> None:
        """Slots ``t0 .. t0 + n_new - 1`` of the layer now hold positions ``length .. length + n_new - 1``."""
        if self._pos[layer] is not None:
            self._pos[layer][:, :, t0 : t0 + n_new] = torch.arange(length, length + n_new, device=self.device)

    def resize(self, layer: int, tokens: int, n: int) -> None:
        """The layer's buffers now have ``tokens`` slots, the first ``n`` kept."""
        old = self._pos[layer]
        if old is not None:
            with torch.inference_mode(False):
                new = torch.zeros((*old.shape[:2], tokens), dtype=old.dtype, device=old.device)
            new[:, :, :n].copy_(old[:, :, :n])
            self._pos[layer] = new

    @torch.inference_mode()
    def keep(self, slots: dict[int, torch.Tensor], *, length: int, capacity: Sequence[int]) -> int:
        """Record that every full layer keeps only ``slots``; gathers their positions (in place).

        Args:
            slots: for each full layer, ``(B, Hkv, n)`` int64 slot indices, ascending per
                head, the same ``n`` for every layer.
            length: the conversation's length (positions ``0 .. length - 1``).
            capacity: per layer, its buffers' slots.

        Returns:
            tokens evicted from each full layer (``held - n``); added to :attr:`evicted`. The
            caller gathers its buffers with the same ``slots`` when it is not 0.

        Raises:
            ValueError: a layer missing or sliding, differing ``n``, indices out of range.
        """
        if sorted(slots) != self.full:
            raise ValueError(f"keep() needs slots for the full-attention layers {self.full}; got {sorted(slots)}")
        sizes = {s.shape[-1] for s in slots.values()}
        held = length - self.evicted
        if len(sizes) != 1 or not 0 < min(sizes) <= held:
            raise ValueError(f"keep(): every layer must keep the same number of slots (1..{held}); got {sorted(sizes)}")
        n = sizes.pop()
        if n == held:
            return 0
        lowest = length
        for i, idx in slots.items():
            if idx.shape[:2] != (self.batch, self.n_kv_heads) or int(idx.min()) < 0 or int(idx.max()) >= held:
                raise ValueError(f"keep(): layer {i}'s slots must be (B, Hkv, n) indices in 0..{held - 1}")
            pos = self.positions(i, 0, held)  # (B, Hkv, held): a full layer's slot 0 is position 0
            gone = torch.ones_like(pos, dtype=torch.bool).scatter_(-1, idx, False)
            if bool(gone.any()):
                lowest = min(lowest, int(pos[gone].min()))
            if self._pos[i] is None:
                with torch.inference_mode(False):
                    self._pos[i] = torch.zeros((self.batch, self.n_kv_heads, capacity[i]), dtype=torch.long,
                                               device=self.device)
                self._pos[i][:, :, :held].copy_(pos)
            buf = self._pos[i]
            buf[:, :, :n].copy_(buf[:, :, :held].gather(2, idx))
        self.evicted += held - n
        self.evictions.append((length, lowest, held - n))
        return held - n

    def crop(self, n: int) -> None:
        """Forget the evictions after length ``n`` (they dropped positions ``>= n`` only: the
        caller checked :meth:`restorable`) and count the rest."""
        self.evictions = [e for e in self.evictions if e[0] <= n]
        self.evicted = sum(e[2] for e in self.evictions)

    def clear(self) -> None:
        """Forget every eviction: slot ``j`` holds position ``first + j`` again."""
        self.evicted = 0
        self.evictions = []
        self._pos = [None] * len(self._pos)
