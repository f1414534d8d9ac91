"""Gradient importance for Explain (:mod:`runtime.insight.explain`): input x gradient and
integrated gradients on a token's log-probability, within a memory budget, with progress and
Cancel between batches of passes.

Must not import Qt. The formulas, the baseline and the measured defaults: see
:mod:`runtime.insight.explain`'s docstring. Gradients need autograd:
:func:`runtime.model.layers.linear` then keeps a 16-bit weight as it is for the backward pass
(widened per product), float32 weights give the exact reference.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from runtime.errors import AttnchatError
from runtime.loader.model import Model

__all__ = ["ExplainCancelled", "IG_BUDGET_BYTES", "IG_RULES", "baseline_token", "check_target", "gradient_importance",
           "ig_batch", "ig_nodes", "pass_bytes", "Passes"]


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
                   base: torch.Tensor):
    """log p(token | b + alpha (x - b)) and its gradient on those embeddings, per alpha.

    Args:
        ctx: ``(1, T)`` token ids (their embeddings are replaced; positions stay).
        x, base: ``(T, C)`` embeddings in the compute dtype.

    Returns:
        (log-probs ``(S,)`` float32, gradients ``(S, T, C)`` float32), ``S = len(alphas)``.
    """
    S = alphas.numel()
    a = alphas.view(S, 1, 1).to(x)
    xs = (base.unsqueeze(0) + a * (x - base).unsqueeze(0)).detach().requires_grad_(True)  # (S, T, C)

    def swap(module, args, out):  # the decoder's embedding lookup gives our embeddings
        return xs

    handle = model.decoder.embed.register_forward_hook(swap)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            logits = model.decoder(ctx.expand(S, -1), last_only=True)  # (S, 1, V)
            lp = torch.log_softmax(logits[:, -1].float(), dim=-1)[:, token]  # (S,)
            (g,) = torch.autograd.grad(lp.sum(), xs)
    finally:
        handle.remove()
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


IG_RULES = ("gauss-legendre", "midpoint")


def ig_nodes(steps: int, rule: str = "gauss-legendre") -> tuple[torch.Tensor, torch.Tensor]:
    """Where integrated gradients evaluate the gradient on the path (``alpha`` in (0, 1)) and
    each point's weight (they sum to 1), float64.

    ``"midpoint"``: ``alpha_k = (k + 1/2) / steps``, equal weights (Sundararajan et al. 2017's
    Riemann sum). ``"gauss-legendre"``: the Gauss-Legendre nodes and weights mapped to (0, 1),
    exact for polynomials of degree ``2 steps - 1`` (Captum's default for the same reason:
    a smooth path integral converges in far fewer steps).

    Raises:
        ValueError: an unknown rule, ``steps`` below 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    if rule == "midpoint":
        return (torch.arange(steps, dtype=torch.float64) + 0.5) / steps, torch.full((steps,), 1 / steps, dtype=torch.float64)
    if rule == "gauss-legendre":
        nodes, weights = np.polynomial.legendre.leggauss(steps)   # on (-1, 1)
        return torch.from_numpy((nodes + 1) / 2), torch.from_numpy(weights / 2)
    raise ValueError(f"unknown rule {rule!r}; use one of {', '.join(IG_RULES)}")


def pass_bytes(model: Model, tokens: int) -> int:
    """About how many bytes one forward-and-backward over ``tokens`` tokens takes beyond the
    model: per layer the activations kept for the backward pass (about fourteen widths of the
    residual stream and five of the MLP per token, float32) and the attention weights (heads x
    tokens x tokens, twice), plus the LM head widened to float32 for a moment. Fitted to the
    default model: 328 tokens, one step at a time, peaked 1,067 MiB above the loaded model
    (Intel Xeon); this gives 1,007."""
    c = model.config
    per_token = 4 * (14 * c.hidden_size + 5 * c.intermediate_size + 4 * c.n_heads * c.head_dim)
    head = 4 * c.vocab_size * c.hidden_size
    return c.n_layers * (tokens * per_token + 2 * 4 * c.n_heads * tokens * tokens) + head


def ig_batch(model: Model, tokens: int, budget: int = IG_BUDGET_BYTES) -> int:
    """How many integrated-gradient steps run in one batch within ``budget`` bytes (1 at least)."""
    return max(1, budget // max(1, pass_bytes(model, tokens)))


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


def gradient_importance(
    model: Model, ids: Sequence[int], target: int = -1, *, method: str = "input_x_gradient", steps: int = 16,
    chunk: int | None = None, positions: int | None = None, rule: str = "gauss-legendre", progress=None,
    cancelled=None, _passes=None,
) -> tuple[list[float], float]:
    """Signed importance of each context token ``0 .. t-1`` for ``log p(ids[t] | ids[:t])``.

    Args:
        ids: token ids of one sequence; ``target`` indexes the token explained (negative: from the end).
        method: ``"input_x_gradient"`` or ``"integrated_gradients"`` (from the :func:`baseline_token`
            baseline, ``steps`` midpoint steps).
        steps: integration steps (integrated gradients only).
        rule: where the steps go on the path and how they are weighed (:func:`ig_nodes`).
        chunk: steps run in one batched forward (memory: ``chunk`` x :func:`pass_bytes`); None:
            as many as :data:`IG_BUDGET_BYTES` holds (:func:`ig_batch`).
        positions: integrated gradients move only the last ``positions`` context tokens from the
            baseline (the others keep their embeddings and get importance 0); None: all but the
            first. Fewer tokens moving make a smoother path: the sum meets ``logp(x) - logp(b)``
            with fewer steps.
        progress: ``(done, total)`` passes, after each batch; ``cancelled``: ``() -> bool``,
            checked before each batch.

    Returns:
        (importances, ``t`` floats in log-prob units (nats); the token's log-prob, or for
        integrated gradients the baseline's log-prob).

    Raises:
        ValueError: a target without context, an unknown method, ``steps`` below 1.
        ExplainCancelled: ``cancelled()`` turned true.
    """
    t = check_target(model, ids, target)
    if method not in ("input_x_gradient", "integrated_gradients"):
        raise ValueError(f"unknown method {method!r}; use input_x_gradient or integrated_gradients")
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    passes = _passes or Passes(1 if method == "input_x_gradient" else steps + 1, progress, cancelled)
    dev = model.device
    ctx = torch.tensor([list(ids[:t])], dtype=torch.long, device=dev)  # (1, t)
    x = _embeddings(model, ctx)  # (t, C)
    token = int(ids[t])
    if method == "input_x_gradient":
        passes.check()
        lp, g = _logprob_grads(model, ctx, token, torch.ones(1), x, torch.zeros_like(x))
        passes.add(1)
        return (x.float() * g[0]).sum(-1).tolist(), float(lp[0])
    base_ids = torch.full_like(ctx, baseline_token(model))
    keep = t - min(positions, t - 1) if positions else 1   # the first token always stays: see the module docstring
    base_ids[:, :keep] = ctx[:, :keep]
    base = _embeddings(model, base_ids)
    alphas, weights = ig_nodes(steps, rule)
    total = torch.zeros_like(x, dtype=torch.float32)
    chunk = chunk or ig_batch(model, t)
    for i in range(0, steps, chunk):
        passes.check()
        _, g = _logprob_grads(model, ctx, token, alphas[i:i + chunk], x, base)
        total += (g * weights[i:i + chunk].view(-1, 1, 1).to(g)).sum(0)
        del g
        passes.add(len(alphas[i:i + chunk]))
    passes.check()
    base_lp, _ = _logprob_grads(model, ctx, token, torch.zeros(1), x, base)
    passes.add(1)
    return ((x - base).float() * total).sum(-1).tolist(), float(base_lp[0])
