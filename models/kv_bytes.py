"""The KV cache's byte formula: bytes per token, per layer and at a context length.

Stdlib only, so the lowest layer that needs it can: the Hub's fit check and the catalog here in
:mod:`models`, the memory planner (:mod:`runtime.memory`) and the KV cache's own byte counts
(:mod:`runtime.cache.kv_bytes`) above. One formula, written once:

    bytes per token and layer = 2 (a key and a value vector) x batch x KV heads x vector bytes
    vector bytes = head dim x element bytes (+ one float32 scale for an int8 cache)

and a layer with a sliding window of ``w`` tokens holds at most ``w`` of them (Mistral, Gemma 2/3,
Phi-3). Default model, float32: 2 x 30 x 3 x 64 x 4 = 46,080 bytes per token.
"""
from __future__ import annotations

from collections.abc import Sequence

#: The answer of :func:`longest_context` when no full-attention layer grows (tokens).
UNBOUNDED = 1 << 40


def vector_bytes(head_dim: int, elem_bytes: int, scale_bytes: int = 0) -> int:
    """Bytes of one key (or value) vector: ``head_dim x elem_bytes + scale_bytes``."""
    return head_dim * elem_bytes + scale_bytes


def layer_bytes_per_token(kv_heads: int, head_dim: int, elem_bytes: int, scale_bytes: int = 0, batch: int = 1) -> int:
    """Bytes one token takes in one layer: 2 (K and V) x batch x KV heads x :func:`vector_bytes`."""
    return 2 * batch * kv_heads * vector_bytes(head_dim, elem_bytes, scale_bytes)


def tokens_held(window: int | None, context: int) -> int:
    """Tokens a layer holds at ``context`` tokens: all for a full layer (``window`` None), else at most its window."""
    return context if window is None else min(context, window)


def bytes_at(windows: Sequence[int | None], kv_heads: int, head_dim: int, elem_bytes: int, context: int,
             scale_bytes: int = 0, batch: int = 1) -> int:
    """KV bytes at ``context`` tokens: per layer :func:`tokens_held` x :func:`layer_bytes_per_token`.

    Args:
        windows: per layer its sliding window in tokens, or None (full attention).
        kv_heads, head_dim: the attention's shape; elem_bytes: bytes per number (float32: 4);
        scale_bytes: bytes of a vector's scale (an int8 cache: 4); batch: sequences.
    """
    per_layer = layer_bytes_per_token(kv_heads, head_dim, elem_bytes, scale_bytes, batch)
    return sum(per_layer * tokens_held(w, context) for w in windows)


def policy_tokens(windows: Sequence[int | None], kv_heads: int, head_dim: int, elem_bytes: int, limit: int,
                  scale_bytes: int = 0, *, batch: int = 1) -> int:
    """The most tokens a cache policy may keep per full-attention layer for the cache to take at
    most ``limit`` bytes, each sliding layer at its whole window (the worst case): ``(limit -
    sliding bytes) // full bytes per token``. 0 or less: not one token fits beside the windows;
    :data:`UNBOUNDED` when no layer is full-attention."""
    per_layer = layer_bytes_per_token(kv_heads, head_dim, elem_bytes, scale_bytes, batch)
    full = per_layer * sum(1 for w in windows if w is None)
    if full == 0:
        return UNBOUNDED
    sliding = per_layer * sum(w for w in windows if w is not None)
    return (limit - sliding) // full


def longest_context(windows: Sequence[int | None], kv_heads: int, head_dim: int, elem_bytes: int, budget: int,
                    scale_bytes: int = 0, *, batch: int = 1, most: int = UNBOUNDED) -> int:
    """The most tokens (at most ``most``) whose KV cache fits ``budget`` bytes (:func:`bytes_at`
    grows with the context: a binary search); ``most`` itself when it fits (with no full
    layer, any context that fits the windows)."""
    def fits(n: int) -> bool:
        return bytes_at(windows, kv_heads, head_dim, elem_bytes, n, scale_bytes, batch) <= budget

    if fits(most):
        return most
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
