"""The KV cache's byte accounting: bytes per token and per layer, what the tokens in use and
the buffers take, the most tokens a byte limit allows, and the figures the panels show.

Must not import Qt. Its own module to keep ``kv_cache.py`` about buffers: these methods run
on a :class:`runtime.cache.kv_cache.KVCache` (the attributes below are its). Byte counts are
per layer (:meth:`ByteAccounting.layer_bytes_per_token`, one figure for every layer today; a
per-layer storage dtype would change only that method).
"""
from __future__ import annotations

import torch

from runtime.dtypes import dtype_name, vector_bytes


class ByteAccounting:
    """Mixin of :class:`runtime.cache.kv_cache.KVCache`: its byte figures."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    batch: int
    windows: tuple[int | None, ...]
    dtype: torch.dtype
    length: int
    max_tokens: int
    limit_bytes: int | None
    k: list[torch.Tensor]
    evicted: int

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of the buffers' dtype (an int8 cache's scales not counted)."""
        return self.dtype.itemsize

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes one token takes in one layer: 2 (K and V) x batch x KV heads x
        :func:`vector_bytes` (head dim x element bytes, plus a float32 scale when quantized)."""
        return 2 * self.batch * self.n_kv_heads * vector_bytes(self.dtype, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer (before any sliding window is full): the
        sum of :meth:`layer_bytes_per_token`."""
        return sum(self.layer_bytes_per_token(i) for i in range(self.n_layers))

    @property
    def sliding(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.windows)

    def layer_tokens(self, layer: int, length: int | None = None) -> int:
        """Tokens layer ``layer`` needs at ``length`` (default: now, and then a full layer's
        tokens a cache policy has evicted are not counted): ``min(length, window)`` for a
        sliding layer, ``length`` for a full one."""
        n = self.length if length is None else length
        w = self.windows[layer]
        if w is None:
            return n - self.evicted if length is None else n
        return min(n, w)

    def bytes_at(self, length: int) -> int:
        """Bytes the layers need at ``length`` tokens: sum over layers of
        :meth:`layer_tokens` x :meth:`layer_bytes_per_token` (the planner's formula)."""
        return sum(self.layer_tokens(i, length) * self.layer_bytes_per_token(i) for i in range(self.n_layers))

    @property
    def used_bytes(self) -> int:
        """Bytes of the tokens in use: :meth:`bytes_at` ``(length)`` less what a cache policy
        evicted (:meth:`layer_tokens` now, summed)."""
        return sum(self.layer_tokens(i) * self.layer_bytes_per_token(i) for i in range(self.n_layers))

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers take: sum over layers of buffer capacity x layer bytes per token."""
        return sum(self.k[i].shape[2] * self.layer_bytes_per_token(i) for i in range(len(self.k)))

    @property
    def token_limit(self) -> int:
        """The most tokens this cache can ever hold (capacity cap and byte limit)."""
        limit = self.max_tokens
        if self.limit_bytes is not None and self.bytes_at(limit) > self.limit_bytes:
            lo, hi = 0, limit  # bytes_at grows with length: the last length that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.bytes_at(mid) <= self.limit_bytes else (lo, mid - 1)
            limit = lo
        return limit

    def layer_types(self) -> list[dict]:
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
                "tokens": self.layer_tokens(idx[0]),
                "used_bytes": sum(self.layer_tokens(i) * self.layer_bytes_per_token(i) for i in idx),
                "allocated_bytes": sum(self.k[i].shape[2] * self.layer_bytes_per_token(i) for i in idx if i < len(self.k)),
            })
        return out

    def stats(self) -> dict:
        """The JSON-ready figures: dtype, bytes_per_token, tokens, used/allocated/limit bytes,
        ``positions``, ``evicted_tokens``, ``full_bytes`` (a cache policy's: ``tokens`` is what
        every full layer holds), and with sliding layers ``layer_types`` (:meth:`layer_types`)."""
        out = {
            "dtype": dtype_name(self.dtype),
            "bytes_per_token": self.bytes_per_token,
            "tokens": self.length - self.evicted,
            "used_bytes": self.used_bytes,
            "allocated_bytes": self.allocated_bytes,
            "limit_bytes": self.limit_bytes,
            # A cache policy's figures: the conversation's tokens (positions) against the tokens
            # held, and the bytes a full cache would take for them (equal without evictions).
            "positions": self.length,
            "evicted_tokens": self.evicted,
            "full_bytes": self.bytes_at(self.length),
        }
        if self.sliding:
            out["layer_types"] = self.layer_types()
        return out
