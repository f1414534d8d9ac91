"""What long context costs in attention: scores computed, and our attention's time per decode step.

Must not import Qt. Each head of each layer scores every query against every key it
sees: a prefill of ``n`` tokens computes ``n * n`` scores per head per layer (a causal
kernel can skip the upper half, ``n (n + 1) / 2``), about a million at 1,000 tokens and
ten billion at 100,000; one decode step at context ``n`` computes ``n``. The timing runs
:func:`runtime.model.attention.attention` (the decoder's own call, on the path
:func:`runtime.model.attention.set_attention_backend` chose) on random q, k, v of the model's
shapes, once per layer, as one decode step would: attention only, not the projections,
the MLP or the KV-cache write.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from runtime.loader.model import Model
from runtime.model.attention import attention

__all__ = ["AttentionStepTime", "attention_step_seconds", "scores_per_head"]


def scores_per_head(n: int, *, prefill: bool) -> int:
    """Attention scores one head of one layer computes for ``n`` tokens of context: ``n * n``
    for a prefill of ``n`` tokens, ``n`` for one decode step at context ``n``."""
    return n * n if prefill else n


@dataclass(frozen=True)
class AttentionStepTime:
    """Median seconds of the attention of one decode step (all layers) at ``context`` keys."""

    context: int
    seconds: float
    per_layer_seconds: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    repeats: int
    device: str
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def attention_step_seconds(model: Model, context: int, *, repeats: int = 5, seed: int = 0) -> AttentionStepTime:
    """Time our attention for one decode step at ``context`` keys (one query per layer).

    One warm-up step, then ``repeats`` timed steps (each: every layer's attention call;
    the device is synchronised by reading one output value back, on any device); the
    median is reported.

    Raises:
        ValueError: ``context`` outside 1..the model's maximum, ``repeats`` below 1.
    """
    c = model.config
    if not 1 <= context <= c.max_position_embeddings:
        raise ValueError(f"a context of {context} tokens is outside 1..{c.max_position_embeddings}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    g = torch.Generator().manual_seed(seed)
    dt = model.compute_dtype
    q = torch.randn(1, c.n_heads, 1, c.head_dim, generator=g).to(model.device, dt)  # (1, H, 1, D)
    k = torch.randn(1, c.n_kv_heads, context, c.head_dim, generator=g).to(model.device, dt)  # (1, Hkv, n, D)
    v = torch.randn(1, c.n_kv_heads, context, c.head_dim, generator=g).to(model.device, dt)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(c.n_layers):
            y = attention(q, k, v, causal=True)
        float(y[0, 0, 0, 0])  # waits for the device
        return time.perf_counter() - t0

    step()
    times = [step() for _ in range(repeats)]
    med = statistics.median(times)
    return AttentionStepTime(context=context, seconds=med, per_layer_seconds=med / c.n_layers, n_layers=c.n_layers,
                             n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, repeats=repeats,
                             device=str(model.device), dtype=str(dt).removeprefix("torch."))
