"""The attention formula by hand: one query against a few keys and values, step by step.

Must not import Qt. ``softmax(q·k / sqrt(d_k)) v`` (Vaswani et al. 2017, eq. 1) for
numbers a learner types, in float64, each step kept: what ``attnchat formula`` prints
and the sandbox in the attention panel shows (the panel redoes it in numpy, as widgets
never import torch; the tests check the two agree). The material's worked example,
the three tokens "the cat sat": K = (0,1), (2,0), (1,1); V = (1,0), (0,1), (1,1);
q = (2,0) gives scores 0, 4, 2, weights 0.045, 0.768, 0.187, output (0.232, 0.955).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

__all__ = ["FormulaByHand", "formula_by_hand"]


@dataclass(frozen=True)
class FormulaByHand:
    """Each step for one query (lists run over the keys, in order).

    ``scores = q·k_j``; ``scaled = scores * scale`` (``scale = 1/sqrt(d_k)``, or 1 with
    scaling off); ``weights = softmax(scaled)`` over the visible keys (masked keys: 0);
    ``output = sum_j weights_j v_j``; ``masked[j]``: key ``j`` is after the query
    (causal mask on).
    """

    scores: list[float]
    scaled: list[float]
    weights: list[float]
    output: list[float]
    masked: list[bool]
    scale: float
    d_k: int

    def to_dict(self) -> dict:
        return asdict(self)


def formula_by_hand(
    q: Sequence[float], keys: Sequence[Sequence[float]], values: Sequence[Sequence[float]], *,
    scale: bool = True, causal_at: int | None = None,
) -> FormulaByHand:
    """``softmax(q·k / sqrt(d_k)) v`` step by step.

    Args:
        q: the query, ``d_k`` numbers.
        keys: one key per token, ``d_k`` numbers each.
        values: one value per token (all of one length, which may differ from ``d_k``).
        scale: divide the scores by ``sqrt(d_k)`` (False: the raw scores go into the softmax).
        causal_at: the query's own position among the keys (zero-based): keys after it
            are masked (weight 0), as in a decoder; None: every key is visible.

    Raises:
        ValueError: empty or ragged vectors, non-finite numbers, as many values as keys
            not given, ``causal_at`` outside the keys.
    """
    if not q or not keys:
        raise ValueError("give a query and at least one key")
    d = len(q)
    if any(len(k) != d for k in keys):
        raise ValueError(f"every key needs {d} numbers, as the query has; got lengths {[len(k) for k in keys]}")
    if len(values) != len(keys):
        raise ValueError(f"give one value per key: {len(keys)} keys but {len(values)} values")
    dv = len(values[0])
    if dv == 0 or any(len(v) != dv for v in values):
        raise ValueError(f"every value needs the same number of numbers; got lengths {[len(v) for v in values]}")
    n = len(keys)
    if causal_at is not None and not 0 <= causal_at < n:
        raise ValueError(f"the query's position {causal_at} is outside the keys 0..{n - 1}")
    qt = torch.tensor(q, dtype=torch.float64)
    K = torch.tensor(keys, dtype=torch.float64)  # (n, d_k)
    V = torch.tensor(values, dtype=torch.float64)  # (n, d_v)
    if not (qt.isfinite().all() and K.isfinite().all() and V.isfinite().all()):
        raise ValueError("every number must be finite")
    s = 1.0 / math.sqrt(d) if scale else 1.0
    scores = K @ qt  # (n,)
    scaled = scores * s
    masked = torch.zeros(n, dtype=torch.bool)
    if causal_at is not None:
        masked[causal_at + 1:] = True
    weights = torch.softmax(scaled.masked_fill(masked, float("-inf")), dim=0)  # (n,), masked keys exactly 0
    out = weights @ V  # (d_v,)
    return FormulaByHand(scores=scores.tolist(), scaled=scaled.tolist(), weights=weights.tolist(),
                         output=out.tolist(), masked=masked.tolist(), scale=s, d_k=d)
