"""Gradient importance for Explain (:mod:`runtime.insight.explain`): input x gradient and
integrated gradients on a token's log-probability, within a memory budget, with progress and
Cancel between batches of passes.

Must not import Qt. The formulas, the baseline and the measured defaults: see
:mod:`runtime.insight.explain`'s docstring. Gradients need autograd:
:func:`runtime.model.layers.linear` then keeps a 16-bit weight as it is for the backward pass
(widened per product), float32 weights give the exact reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from runtime.errors import AttnchatError
from runtime.insight.integrated import IG_TOLERANCE, FrozenPrefix, adaptive_simpson, frozen_prefix, run_embedded
from runtime.loader.model import Model

__all__ = ["ExplainCancelled", "IG_BUDGET_BYTES", "IG_RULES", "IntegratedGradients", "baseline_token", "check_target",
           "gradient_importance", "ig_batch", "ig_nodes", "integrated_gradients", "moved_tokens", "pass_bytes", "Passes",
           "widened_bytes"]


def check_target(model: Model, ids: Sequence[int], target: int) -> int:
    """``target`` (negative: from the end) as a position ``1 .. len(ids) - 1``.

    Raises:
        ValueError: a target without context, or past the model's maximum position.
    """
    T = len(ids)
    t = target + T if target < 0 else target
    if not 1 <= t < T:
        raise ValueError(f"token position {target} is outside 1..{T - 1} (the first token has no context to explain it)")
    if t > model.config.max_position_embeddings:
        raise ValueError(f"{t} tokens of context pass the model's maximum of {model.config.max_position_embeddings}")
    return t


def _logprob_grads(model: Model, ctx: torch.Tensor, token: int, alphas: torch.Tensor, x: torch.Tensor,
                   base: torch.Tensor, prefix: FrozenPrefix | None = None):
    """log p(token | b + alpha (x - b)) and its gradient on those embeddings, per alpha.

    Args:
        ctx: ``(1, T)`` token ids (their embeddings are replaced; positions stay); with a
            ``prefix`` (:func:`runtime.insight.integrated.frozen_prefix`), the ids after it.
        x, base: ``(T, C)`` embeddings in the compute dtype, of the ids in ``ctx``.

    Returns:
        (log-probs ``(S,)`` float32, gradients ``(S, T, C)`` float32), ``S = len(alphas)``.
    """
    S = alphas.numel()
    a = alphas.view(S, 1, 1).to(x)
    xs = (base.unsqueeze(0) + a * (x - base).unsqueeze(0)).detach().requires_grad_(True)  # (S, T, C)
    with torch.inference_mode(False), torch.enable_grad():
        logits = run_embedded(model, ctx.expand(S, -1), xs, prefix)  # (S, 1, V)
        lp = torch.log_softmax(logits[:, -1].float(), dim=-1)[:, token]  # (S,)
        (g,) = torch.autograd.grad(lp.sum(), xs)
    return lp.detach(), g.float()


def baseline_token(model: Model) -> int:
    """The integrated-gradients baseline's token: padding, else end of sequence, else 0."""
    tok = model.tokenizer
    for tid in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if isinstance(tid, int) and 0 <= tid < model.config.vocab_size:
            return tid
    return 0


def _embeddings(model: Model, ids: torch.Tensor) -> torch.Tensor:
    """``ids (1, T)`` -> ``(T, C)`` in the compute dtype, outside autograd."""
    with torch.inference_mode(False), torch.no_grad():
        return model.decoder.embed(ids)[0].to(model.decoder.compute_dtype).clone()


#: Bytes the integrated-gradient steps of one batch may keep for their backward pass (the
#: batch is as many steps as fit; one at least). 16 steps at once over 328 tokens of the
#: default model took the app from 650 MiB to 5.4 GiB (Intel Xeon).
IG_BUDGET_BYTES = 512 * 2**20


IG_RULES = ("adaptive", "gauss-legendre", "midpoint")


def ig_nodes(steps: int, rule: str = "gauss-legendre") -> tuple[torch.Tensor, torch.Tensor]:
    """Where a fixed rule evaluates the gradient on the path (``alpha`` in (0, 1)) and each
    point's weight (they sum to 1), float64. (``"adaptive"`` chooses its points as it goes:
    :func:`runtime.insight.integrated.adaptive_simpson`.)

    ``"midpoint"``: ``alpha_k = (k + 1/2) / steps``, equal weights (Sundararajan et al. 2017's
    Riemann sum). ``"gauss-legendre"``: the Gauss-Legendre nodes and weights mapped to (0, 1),
    exact for polynomials of degree ``2 steps - 1`` (Captum's default).

    Raises:
        ValueError: an unknown or adaptive rule, ``steps`` below 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    if rule == "midpoint":
        return (torch.arange(steps, dtype=torch.float64) + 0.5) / steps, torch.full((steps,), 1 / steps, dtype=torch.float64)
    if rule == "gauss-legendre":
        nodes, weights = np.polynomial.legendre.leggauss(steps)   # on (-1, 1)
        return torch.from_numpy((nodes + 1) / 2), torch.from_numpy(weights / 2)
    raise ValueError(f"rule {rule!r} has no fixed nodes; use one of gauss-legendre, midpoint")


def widened_bytes(model: Model) -> int:
    """Bytes gradient passes widen beyond the loaded model and keep: a quantized matrix (GGUF
    blocks) becomes float32 for autograd (every layer's and the LM head's: kept for the whole
    Explain, :func:`runtime.model.quant_layers.widened_for_gradients`); a 16-bit one is widened
    per product and keeps nothing."""
    from runtime.model.quant_layers import quant_layers

    return sum(4 * m.out_features * m.in_features for m in quant_layers(model.decoder))


def pass_bytes(model: Model, tokens: int, keys: int | None = None) -> int:
    """About how many bytes one step's forward-and-backward over ``tokens`` tokens attending to
    ``keys`` keys (default: ``tokens``) keeps for its backward pass: per layer and token about
    eight widths of the residual stream (two more with Gemma's norms after attention and the
    MLP), five of the MLP and two of the query, key and value projections, in float32; a model
    whose attention soft-caps its scores (no fused kernel) also keeps the weights, heads x
    tokens x keys, twice. Measured (Intel Xeon): the default model, a batch of 2, 4 and 8 steps
    of 64 tokens over 302 keys 217, 404 and 807 MiB (this gives 104 per step), one pass over
    302 tokens about 390 (this gives 491); Gemma 3 270M, 7 steps of 64 over 260 keys about 100
    per step (this gives 87), one pass over 260 tokens about 600 (this gives 352: that pass is
    said low for Gemma). A batch of steps adds :func:`widened_bytes` once (:func:`explain_cost`)."""
    c = model.config
    keys = tokens if keys is None else keys
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    per_token = 4 * ((10 if c.sandwich_norms else 8) * c.hidden_size + 5 * c.intermediate_size + 2 * qkv)
    weights = 2 * 4 * c.n_heads * tokens * keys if c.attn_softcap else 0
    return c.n_layers * (tokens * per_token + weights)


def ig_batch(model: Model, tokens: int, budget: int = IG_BUDGET_BYTES, keys: int | None = None) -> int:
    """How many integrated-gradient steps run in one batch within ``budget`` bytes (1 at least)."""
    return max(1, budget // max(1, pass_bytes(model, tokens, keys)))


class ExplainCancelled(AttnchatError):
    """Explain was cancelled (``cancelled()`` turned true between two passes)."""


class Passes:
    """Counts the passes (forward and backward, or forward) done for ``progress(done, total)``
    and checks ``cancelled()`` before each."""

    def __init__(self, total: int, progress=None, cancelled=None):
        self.total, self.done = total, 0
        self.progress, self.cancelled = progress, cancelled

    def check(self) -> None:
        if self.cancelled is not None and self.cancelled():
            raise ExplainCancelled("cancelled")

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


@dataclass(frozen=True)
class IntegratedGradients:
    """Integrated gradients for one token (:func:`integrated_gradients`).

    ``importances``: one float per context token ``0 .. t-1`` (nats; 0 for the tokens that did
    not move); ``log_prob``, ``base_log_prob``: ``f(1)`` and ``f(0)`` on the path; ``gap``: the
    integration error ``sum(importances) - (log_prob - base_log_prob)``; ``steps``: the gradient
    passes run; ``moved``: the last context tokens that moved; ``batch``: steps per batch.
    """

    importances: list[float]
    log_prob: float
    base_log_prob: float
    gap: float
    steps: int
    moved: int
    batch: int


def moved_tokens(t: int, positions: int | None) -> int:
    """How many of ``t`` context tokens integrated gradients move: the last ``positions``, never
    the first (see :mod:`runtime.insight.explain`); None: all but the first."""
    return min(positions, t - 1) if positions else t - 1


def integrated_gradients(
    model: Model, ids: Sequence[int], target: int = -1, *, steps: int = 16, positions: int | None = None,
    rule: str = "adaptive", tolerance: float = IG_TOLERANCE, chunk: int | None = None, progress=None,
    cancelled=None, _passes=None,
) -> IntegratedGradients:
    """Integrated gradients of ``log p(ids[t] | ids[:t])`` from the :func:`baseline_token`
    baseline, over the last ``positions`` context tokens (the tokens before them are a
    :class:`~runtime.insight.integrated.FrozenPrefix`, computed once).

    Args:
        steps: gradient passes: the most for ``"adaptive"`` (at least 3), exactly that many
            (plus one for ``f(0)``) for a fixed rule (:func:`ig_nodes`).
        rule: ``"adaptive"`` (:func:`~runtime.insight.integrated.adaptive_simpson`, stops at
            ``tolerance``), ``"gauss-legendre"`` or ``"midpoint"``.
        chunk: steps per batch (memory: ``chunk`` x :func:`pass_bytes`); None: as many as
            :data:`IG_BUDGET_BYTES` holds (:func:`ig_batch`).
        progress, cancelled: as :func:`gradient_importance`.

    Raises:
        ValueError: a target without context, an unknown rule, too few steps.
        ExplainCancelled: ``cancelled()`` turned true.
    """
    t = check_target(model, ids, target)
    if rule not in IG_RULES:
        raise ValueError(f"unknown rule {rule!r}; use one of {', '.join(IG_RULES)}")
    if steps < (3 if rule == "adaptive" else 1):
        raise ValueError(f"steps must be at least {3 if rule == 'adaptive' else 1} for the {rule} rule; got {steps}")
    passes = _passes or Passes(steps + (rule != "adaptive"), progress, cancelled)
    ctx = torch.tensor([list(ids[:t])], dtype=torch.long, device=model.device)  # (1, t)
    moved = moved_tokens(t, positions)
    keep = t - moved
    x = _embeddings(model, ctx)  # (t, C)
    base_ids = torch.full_like(ctx, baseline_token(model))
    base_ids[:, :keep] = ctx[:, :keep]
    base = _embeddings(model, base_ids)
    passes.check()
    prefix = frozen_prefix(model, ctx[:, :keep], x[:keep])
    tail, xt, bt = ctx[:, keep:], x[keep:], base[keep:]
    dx = (xt - bt).float()  # (moved, C)
    token = int(ids[t])
    batch = chunk or ig_batch(model, moved, IG_BUDGET_BYTES, keys=t)   # the budget read now: tests lower it

    def evaluate(alphas: list[float]) -> tuple[list[float], torch.Tensor]:
        lp, g = _logprob_grads(model, tail, token, torch.tensor(alphas, dtype=torch.float64), xt, bt, prefix)
        return lp.tolist(), (g * dx).sum(-1)   # (S,), (S, moved): each token's directional gradient

    if rule == "adaptive":
        used_before = passes.done
        got, f0, f1, gap, n = adaptive_simpson(evaluate, steps, batch, tolerance, passes.check, passes.add)
        if passes.done - used_before < steps:   # the budget left unused: progress reaches its end
            passes.check()
            passes.add(steps - (passes.done - used_before))
    else:
        alphas, weights = ig_nodes(steps, rule)
        got = torch.zeros(moved)
        for i in range(0, steps, batch):
            passes.check()
            _, d = evaluate(alphas[i:i + batch].tolist())
            got += (d * weights[i:i + batch].view(-1, 1).to(d)).sum(0)
            passes.add(len(alphas[i:i + batch]))
        passes.check()
        (f0, f1), _ = evaluate([0.0, 1.0])
        passes.add(1)
        gap, n = float(got.sum()) - (f1 - f0), steps + 1
    importances = [0.0] * keep + got.tolist()
    return IntegratedGradients(importances, float(f1), float(f0), float(gap), n, moved, batch)


def gradient_importance(
    model: Model, ids: Sequence[int], target: int = -1, *, method: str = "input_x_gradient", steps: int = 16,
    chunk: int | None = None, positions: int | None = None, rule: str = "gauss-legendre", progress=None,
    cancelled=None, _passes=None,
) -> tuple[list[float], float]:
    """Signed importance of each context token ``0 .. t-1`` for ``log p(ids[t] | ids[:t])``.

    Args:
        ids: token ids of one sequence; ``target`` indexes the token explained (negative: from the end).
        method: ``"input_x_gradient"`` or ``"integrated_gradients"`` (:func:`integrated_gradients`,
            with ``steps``, ``rule``, ``chunk`` and ``positions``).
        progress: ``(done, total)`` passes, after each batch; ``cancelled``: ``() -> bool``,
            checked before each batch.

    Returns:
        (importances, ``t`` floats in log-prob units (nats); the token's log-prob, or for
        integrated gradients the baseline's log-prob).

    Raises:
        ValueError: a target without context, an unknown method or rule, too few steps.
        ExplainCancelled: ``cancelled()`` turned true.
    """
    t = check_target(model, ids, target)
    if method == "integrated_gradients":
        r = integrated_gradients(model, ids, t, steps=steps, positions=positions, rule=rule, chunk=chunk,
                                 progress=progress, cancelled=cancelled, _passes=_passes)
        return r.importances, r.base_log_prob
    if method != "input_x_gradient":
        raise ValueError(f"unknown method {method!r}; use input_x_gradient or integrated_gradients")
    passes = _passes or Passes(1, progress, cancelled)
    ctx = torch.tensor([list(ids[:t])], dtype=torch.long, device=model.device)  # (1, t)
    x = _embeddings(model, ctx)  # (t, C)
    passes.check()
    lp, g = _logprob_grads(model, ctx, int(ids[t]), torch.ones(1), x, torch.zeros_like(x))
    passes.add(1)
    return (x.float() * g[0]).sum(-1).tolist(), float(lp[0])
