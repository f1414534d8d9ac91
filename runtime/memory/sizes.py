"""How many bytes a KV cache takes: per token, per layer type and per attention variant, for
full, sliding-window and int8 caches, as the planner reports them.

Must not import Qt. Pure arithmetic over shapes (no tensors are made), every figure from the one
formula in :mod:`models.kv_bytes` (``bytes_at``, ``longest_context`` come from there).
"""
from __future__ import annotations

from typing import Sequence

import torch

from models.kv_bytes import bytes_at, layer_bytes_per_token, tokens_held
from runtime.dtypes import cache_number_bytes, parse_cache_dtype


def element_bytes(dtype: str | torch.dtype) -> int:
    """Bytes of one element of a cache or weight dtype (float32: 4, bfloat16/float16: 2)."""
    return parse_cache_dtype(dtype).itemsize


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """2 x layers x KV heads x head dim x bytes per element.

    Raises:
        ValueError: a non-positive number.
    """
    for name, value in (("layers", layers), ("KV heads", kv_heads), ("head dim", head_dim), ("bytes per element", elem_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be positive; got {value}")
    return layers * layer_bytes_per_token(kv_heads, head_dim, elem_bytes)


def cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, cache_dtype: str | torch.dtype) -> int:
    """KV bytes per token in a cache of ``cache_dtype``: 2 x layers x KV heads x
    :func:`runtime.dtypes.vector_bytes` (an int8 cache: head dim + 4 bytes of scale per
    vector; default model 2 x 30 x 3 x 68 = 12,240).

    Raises:
        ValueError: a non-positive number or an unknown dtype.
    """
    kv_bytes_per_token(layers, kv_heads, head_dim, 1)  # the checks
    return layers * layer_bytes_per_token(kv_heads, head_dim, *cache_number_bytes(cache_dtype))


def layer_type_figures(windows: Sequence[int | None], kv_heads: int, head_dim: int, elem_bytes: int, context: int,
                       scale_bytes: int = 0, *, policy: int | None = None) -> list[dict]:
    """Per kind of layer (full first, then each window): kind, window, layers,
    bytes_per_token, tokens and used_bytes at ``context`` (the KV cache's
    ``layer_types()`` fields); ``policy``: a cache policy's budget, the most a full layer holds."""
    per_layer = layer_bytes_per_token(kv_heads, head_dim, elem_bytes, scale_bytes)
    out = []
    for w in sorted(set(windows), key=lambda w: -1 if w is None else w):
        n = sum(1 for x in windows if x == w)
        tokens = tokens_held(w if w is not None or policy is None else policy, context)
        out.append({"kind": "full" if w is None else "sliding", "window": w, "layers": n,
                    "bytes_per_token": n * per_layer, "tokens": tokens, "used_bytes": n * per_layer * tokens})
    return out


def attention_variants(windows: Sequence[int | None], kv_heads: int, head_dim: int, elem_bytes: int, context: int,
                       *, n_heads: int | None = None, scale_bytes: int = 0) -> list[dict]:
    """What the KV cache would take under each attention variant, for this shape at ``context``.

    ``multi-head``: one KV head per query head (needs ``n_heads``); ``grouped-query``: the
    model's KV heads, every layer full (only when between 1 and ``n_heads``);
    ``multi-query``: one KV head; ``sliding-window``: the model's KV heads, every layer
    with the model's window (or :data:`DEFAULT_COMPARISON_WINDOW`). The model's own
    (its KV heads, its windows) is marked ``this_model``.
    """
    L = len(windows)
    window = next((w for w in windows if w is not None), None) or DEFAULT_COMPARISON_WINDOW
    rows = []

    def row(name, heads, ws):
        rows.append({
            "name": name, "kv_heads": heads, "window": next((w for w in ws if w is not None), None),
            "windowed_layers": sum(1 for w in ws if w is not None),
            "bytes_per_token": L * layer_bytes_per_token(heads, head_dim, elem_bytes, scale_bytes),
            "bytes_at_context": bytes_at(ws, heads, head_dim, elem_bytes, context, scale_bytes),
            "this_model": heads == kv_heads and tuple(ws) == tuple(windows),
        })

    full = (None,) * L
    if n_heads is not None:
        row("multi-head", n_heads, full)
    if n_heads is None or 1 < kv_heads < n_heads:
        row("grouped-query", kv_heads, full)
    row("multi-query", 1, full)
    row("sliding-window", kv_heads, (window,) * L)
    if not any(r["this_model"] for r in rows):
        row("this model", kv_heads, tuple(windows))
    return rows


#: The window the comparison uses for a model without one (Mistral 7B v0.1's).
DEFAULT_COMPARISON_WINDOW = 4096
