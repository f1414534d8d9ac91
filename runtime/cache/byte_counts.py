"""The KV cache's byte figures: bytes per token and per layer, what the tokens in use and the
buffers take, the most tokens a byte limit allows, and the figures the panels show.

Must not import Qt. A :class:`runtime.cache.kv_cache.KVCache` owns one (its ``bytes``) and passes
what changes (its length, what a policy evicted, its buffers' capacities); the arithmetic is
the one formula of :mod:`models.kv_bytes`, which the planner and the Hub's fit check use too.
Byte counts are per layer (:meth:`ByteCounts.layer_bytes_per_token`, one figure for every
layer today; a per-layer storage dtype would change only that method).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from models import kv_bytes
from runtime.dtypes import cache_number_bytes, dtype_name

#: Tokens per page of the paged pool (:data:`runtime.cache.paged.pool.PAGE_TOKENS`, the same
#: number: that module imports this one's constant).
PAGE_TOKENS = 16


class ByteCounts:
    """Byte figures of a cache of this shape.

    Args:
        windows: per layer its sliding window in tokens or None (full attention).
        batch, n_kv_heads, head_dim: the cache's shape; dtype: its element dtype.
    """

    def __init__(self, windows: Sequence[int | None], batch: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.windows = tuple(windows)
        self.batch, self.n_kv_heads, self.head_dim, self.dtype = batch, n_kv_heads, head_dim, dtype
        self._numbers = cache_number_bytes(dtype)  # (element bytes, scale bytes per vector)
        self._per_layer = kv_bytes.layer_bytes_per_token(n_kv_heads, head_dim, *self._numbers, batch=batch)

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes one token takes in one layer: 2 (K and V) x batch x KV heads x vector bytes
        (head dim x element bytes, plus a float32 scale when quantized)."""
        return self._per_layer

    @property
    def per_token(self) -> int:
        """Bytes one token takes in every layer (before any sliding window is full)."""
        return sum(self.layer_bytes_per_token(i) for i in range(len(self.windows)))

    def layer_tokens(self, layer: int, length: int, evicted: int = 0) -> int:
        """Tokens layer ``layer`` holds at ``length``: ``min(length, window)`` for a sliding
        layer, ``length - evicted`` for a full one (``evicted``: what a cache policy took)."""
        w = self.windows[layer]
        return length - evicted if w is None else kv_bytes.tokens_held(w, length)

    def at(self, length: int) -> int:
        """Bytes the layers need at ``length`` tokens (nothing evicted): the planner's formula."""
        elem, scale = self._numbers
        return kv_bytes.bytes_at(self.windows, self.n_kv_heads, self.head_dim, elem, length, scale, batch=self.batch)

    def used(self, length: int, evicted: int) -> int:
        """Bytes of the tokens in use: :meth:`layer_tokens` x :meth:`layer_bytes_per_token`, summed."""
        return sum(self.layer_tokens(i, length, evicted) * self.layer_bytes_per_token(i)
                   for i in range(len(self.windows)))

    def allocated(self, capacity: Sequence[int]) -> int:
        """Bytes the buffers take: per layer its buffers' slots (``capacity``) x layer bytes per token."""
        return sum(c * self.layer_bytes_per_token(i) for i, c in enumerate(capacity))

    def growth(self, grow: dict[int, int], capacity: Sequence[int]) -> tuple[int, int]:
        """``(peak bytes needed, bytes of the new buffers)`` for growing layer ``i`` to ``grow[i]``
        slots from ``capacity[i]`` (0 past the list). Layer by layer, the new K and V buffers
        exist next to that layer's old ones while its tokens are copied over: the growth plus
        one layer's old buffers at the peak (all layers at once would briefly double the cache)."""
        old = {i: capacity[i] if i < len(capacity) else 0 for i in grow}
        need = sum((cap - old[i]) * self.layer_bytes_per_token(i) for i, cap in grow.items())
        need += max(old[i] * self.layer_bytes_per_token(i) for i in grow)
        return need, sum(cap * self.layer_bytes_per_token(i) for i, cap in grow.items())

    def token_limit(self, max_tokens: int, limit_bytes: int | None) -> int:
        """The most tokens a cache of at most ``max_tokens`` can hold in ``limit_bytes`` (None: no cap)."""
        if limit_bytes is None:
            return max_tokens
        elem, scale = self._numbers
        return kv_bytes.longest_context(self.windows, self.n_kv_heads, self.head_dim, elem, limit_bytes, scale,
                                        batch=self.batch, most=max_tokens)

    def layer_types(self, length: int, evicted: int, capacity: Sequence[int]) -> list[dict]:
        """Per kind of layer (full, then each window): ``window`` (tokens or None),
        ``layers``, ``bytes_per_token`` (those layers together), ``tokens`` (each holds),
        ``used_bytes`` and ``allocated_bytes``."""
        groups: dict[int | None, list[int]] = {}
        for i, w in enumerate(self.windows):
            groups.setdefault(w, []).append(i)
        out = []
        for w in sorted(groups, key=lambda w: -1 if w is None else w):
            idx = groups[w]
            out.append({
                "kind": "full" if w is None else "sliding",
                "window": w,
                "layers": len(idx),
                "bytes_per_token": sum(self.layer_bytes_per_token(i) for i in idx),
                "tokens": self.layer_tokens(idx[0], length, evicted),
                "used_bytes": sum(self.layer_tokens(i, length, evicted) * self.layer_bytes_per_token(i) for i in idx),
                "allocated_bytes": sum(capacity[i] * self.layer_bytes_per_token(i) for i in idx if i < len(capacity)),
            })
        return out

    def stats(self, length: int, evicted: int, capacity: Sequence[int], limit_bytes: int | None) -> dict:
        """The JSON-ready figures: dtype, bytes_per_token, tokens, used/allocated/limit bytes,
        ``positions``, ``evicted_tokens``, ``full_bytes`` (a cache policy's: ``tokens`` is what
        every full layer holds), ``pages`` (:meth:`pages`), and with sliding layers ``layer_types``
        (:meth:`layer_types`)."""
        out = {
            "dtype": dtype_name(self.dtype),
            "bytes_per_token": self.per_token,
            "tokens": length - evicted,
            "used_bytes": self.used(length, evicted),
            "allocated_bytes": self.allocated(capacity),
            "limit_bytes": limit_bytes,
            # A cache policy's figures: the conversation's tokens (positions) against the tokens
            # held, and the bytes a full cache would take for them (equal without evictions).
            "positions": length,
            "evicted_tokens": evicted,
            "full_bytes": self.at(length),
        }
        if any(w is not None for w in self.windows):
            out["layer_types"] = self.layer_types(length, evicted, capacity)
        out["pages"] = self.pages(out["used_bytes"], out["allocated_bytes"])
        return out

    def pages(self, used_bytes: int, allocated_bytes: int, page_tokens: int = PAGE_TOKENS) -> dict:
        """This cache's bytes in the pages of the server's paged pool (:mod:`runtime.cache.paged`):
        ``page_tokens``, ``bytes_per_page`` (``page_tokens`` x :attr:`per_token`), ``used`` (pages
        its tokens fill, rounded up), ``shared`` (0: a contiguous cache is one conversation's own)
        and ``free`` (whole pages of its buffers beyond them)."""
        per_page = page_tokens * self.per_token
        used = -(-used_bytes // per_page)
        return {"page_tokens": page_tokens, "bytes_per_page": per_page, "used": used, "shared": 0,
                "free": max(0, allocated_bytes // per_page - used)}
