"""Does attention explain this token? Jain and Wallace's two tests on our decoder.

Must not import Qt. Jain and Wallace 2019, "Attention is not Explanation" (NAACL),
ask two questions of the attention weights behind a prediction:

1. Do they rank the inputs as a gradient-based importance does? Here: for the token at
   position ``t`` (its log-probability, predicted at query position ``t - 1``), each
   context token ``j < t`` gets an importance from the gradient on its embedding
   ``x_j``: input x gradient ``sum_c x_jc * d logp / d x_jc`` (Shrikumar et al. 2016),
   and integrated gradients (Sundararajan et al. 2017) along the straight path from a
   baseline ``b``, ``sum_c (x - b)_jc * sum_k w_k g_jc(b + a_k (x - b))`` over ``steps``
   Gauss-Legendre nodes ``a_k`` and weights ``w_k`` (:func:`ig_nodes`; midpoints as an
   option); their sum approaches ``logp(x) - logp(b)`` (completeness) as ``steps``
   grows. Only the last ``positions`` context tokens move (:data:`IG_POSITIONS`; the
   others keep their embeddings and get importance 0), and tau is taken over them: on
   the default model, a 328-token chat's last reply token (AMD EPYC Zen 3), moving all
   327 tokens left an error of -66.6 of a 3.9 change with 16 midpoint steps, 16 tokens
   -1.7 of 12.6 (13 %); 32 tokens with 8 Gauss-Legendre nodes 2.6 of 11.7 (22 %), with
   16 nodes -0.20 of 11.7 (1.7 %, inside the 10 % the panel accepts). The baseline is the padding token's embedding
   (else the end-of-sequence token's) at every position but the first, which keeps its
   own: a real input. The common all-zero embedding is not one for RMSNorm models
   without biases (SmolLM, Llama): zero stays zero through every block and the final
   norm turns any small multiple of ``x`` into a full-size state, so ``logp`` jumps at
   0 and no step count integrates it. The first token is where most heads rest (the
   attention sink, Xiao et al. 2023); moving it moves the whole model's largest
   activations, and the path then needs many more steps (on the default model, 32
   steps left a 64 % error with it moved and 20 % with it kept, for one 12-token
   example). It gets importance 0, as does any context token that is the baseline token. ``Explanation.ig_gap`` reports the error: raise
   ``steps`` when it is large. Kendall's tau-b compares the ranking of the
   attention row with the ranking of ``|importance|`` (Jain and Wallace rank by
   magnitude).
2. Would other weights give the same prediction? Permute the head's weights over the
   keys ``n`` times (seeded) at the predicting query, keep everything else, and measure
   how far the next-token distribution moves: the total variation distance
   ``0.5 * sum |p - p'|`` (median over the permutations) and how often the most likely
   token changes. Jain and Wallace permute the one attention layer of their models;
   here one head (or, for the layer mean, every head of that layer with the same
   permutation) of one layer of a deep decoder is permuted, so other layers and heads
   can make up for it: a small change says that this head's weights do not matter for
   this token, not that attention in general does not.

Gradients need autograd: :func:`runtime.model.layers.linear` then takes ``F.linear``; the
model's weights may stay float16 (they are widened per product), float32 gives the
exact reference.
"""
from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from runtime.device import trim_heap
from runtime.errors import AttnchatError
from runtime.generate.chat_format import Message, encode_messages
from runtime.insight.ablation import edited
from runtime.insight.attention_view import layer_qkv
from runtime.insight.probe import AttentionCapture
from runtime.loader.model import Model
from runtime.model.attention import attention_reference

__all__ = ["ExplainCancelled", "Explanation", "IG_BUDGET_BYTES", "IG_POSITIONS", "IG_STEPS", "Permutation",
           "baseline_token", "explain_cost", "explain_token", "gradient_importance", "ig_batch", "kendall_tau",
           "pass_bytes", "permutation_test", "reply_positions", "summary_sentence"]

#: Explain's defaults: integrated gradients in this many Gauss-Legendre steps, moving the last
#: this many context tokens (see :func:`gradient_importance`; measured: the module docstring).
IG_STEPS = 16
IG_POSITIONS: int | None = 32


def kendall_tau(a: Sequence[float] | torch.Tensor, b: Sequence[float] | torch.Tensor) -> float:
    """Kendall's tau-b between two equal-length sequences, in [-1, 1] (ties handled as tau-b).

    ``(concordant - discordant) / sqrt(pairs untied in a * pairs untied in b)`` over all
    pairs ``i < j`` (Kendall 1945); NaN when either sequence is constant.

    Raises:
        ValueError: lengths differ or fewer than two values.
    """
    x = torch.as_tensor(a, dtype=torch.float64).flatten()
    y = torch.as_tensor(b, dtype=torch.float64).flatten()
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"kendall_tau needs two sequences of the same length >= 2; got {x.numel()} and {y.numel()}")
    n = x.numel()
    s = na = nb = 0.0
    for i0 in range(0, n, 512):  # rows of the pair matrix in blocks: memory stays O(512 n)
        dx = torch.sign(x[i0:i0 + 512, None] - x[None, :])  # (r, n)
        dy = torch.sign(y[i0:i0 + 512, None] - y[None, :])
        s += float((dx * dy).sum())
        na += float(dx.abs().sum())
        nb += float(dy.abs().sum())
    # Each unordered pair was counted twice (i, j and j, i): the ratio is unchanged.
    if na == 0 or nb == 0:
        return float("nan")
    return s / math.sqrt(na * nb)


def _check_target(model: Model, ids: Sequence[int], target: int) -> int:
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
#: default model took the app from 650 MiB to 5.4 GiB (AMD EPYC Zen 3).
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
    (AMD EPYC Zen 3); this gives 1,007."""
    c = model.config
    per_token = 4 * (14 * c.hidden_size + 5 * c.intermediate_size + 4 * c.n_heads * c.head_dim)
    head = 4 * c.vocab_size * c.hidden_size
    return c.n_layers * (tokens * per_token + 2 * 4 * c.n_heads * tokens * tokens) + head


def ig_batch(model: Model, tokens: int, budget: int = IG_BUDGET_BYTES) -> int:
    """How many integrated-gradient steps run in one batch within ``budget`` bytes (1 at least)."""
    return max(1, budget // max(1, pass_bytes(model, tokens)))


class ExplainCancelled(AttnchatError):
    """Explain was cancelled (``cancelled()`` turned true between two passes)."""


class _Passes:
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
    t = _check_target(model, ids, target)
    if method not in ("input_x_gradient", "integrated_gradients"):
        raise ValueError(f"unknown method {method!r}; use input_x_gradient or integrated_gradients")
    if steps < 1:
        raise ValueError(f"steps must be at least 1; got {steps}")
    passes = _passes or _Passes(1 if method == "input_x_gradient" else steps + 1, progress, cancelled)
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


def _attention_row(model: Model, ctx: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's weights of the last query ``(H, t)`` and the layer's values ``(Hkv, t, D)``."""
    q, k, v = layer_qkv(model, ctx, layer)  # (1, H, t, D), (1, Hkv, t, D) x 2
    _, w = attention_reference(q[:, :, -1:], k, v)  # (1, H, 1, t)
    return w[0, :, 0], v[0]


@dataclass(frozen=True)
class Permutation:
    """The permutation counterfactual: ``n`` seeded permutations of the head's weights over the keys.

    ``tv``: total variation distance of each permuted next-token distribution from the
    original, in [0, 1]; ``median_tv`` their median; ``top_changed``: the fraction of
    permutations whose most likely token differs from the original's.
    """

    n: int
    seed: int
    tv: list[float]
    median_tv: float
    top_changed: float


def _heads(model: Model, head: int | str) -> list[int]:
    H = model.config.n_heads
    if head == "mean":
        return list(range(H))
    if not (isinstance(head, int) and 0 <= head < H):
        raise ValueError(f"head {head!r} is outside 0..{H - 1} (or 'mean')")
    return [head]


def permutation_test(
    model: Model, ids: Sequence[int], target: int, layer: int, head: int | str = 0, *, n: int = 32, seed: int = 0,
    chunk: int = 8, progress=None, cancelled=None, _passes=None,
) -> Permutation:
    """Permute ``head``'s weights (``"mean"``: every head of ``layer``, each by the same
    permutation) at the query predicting ``ids[target]``, ``n`` times (``torch.Generator``
    seeded with ``seed``); the rest of the forward is unchanged.

    Raises:
        ValueError: a target without context, a layer or head out of range, ``n`` below 1.
    """
    t = _check_target(model, ids, target)
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.n_layers - 1}")
    heads = _heads(model, head)
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    passes = _passes or _Passes(n, progress, cancelled)
    ctx = list(ids[:t])
    w, v = _attention_row(model, ctx, layer)  # (H, t), (Hkv, t, D)
    group = model.config.n_heads // model.config.n_kv_heads
    with torch.inference_mode():
        p0 = torch.softmax(model.logits(ctx, last_only=True)[0, -1].float(), -1)  # (V,)
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(t, generator=g) for _ in range(n)]
    # The permuted heads' outputs at the last query: (n, k, D) = permuted weights @ values.
    outs = torch.stack([
        torch.stack([w[h][p.to(w.device)] @ v[h // group].float() for h in heads]) for p in perms
    ])
    idx = torch.tensor(heads)
    tv, changed = [], 0
    for i in range(0, n, chunk):
        passes.check()
        part = outs[i:i + chunk]  # (b, k, D)

        def swap(_layer: int, y: torch.Tensor, part=part) -> torch.Tensor:
            y = y.clone()  # (b, H, t, D)
            y[:, idx.to(y.device), -1] = part.to(y)
            return y

        with edited(model, swap, [layer]), torch.inference_mode():
            logits = model.logits(torch.tensor([ctx] * part.shape[0]), last_only=True)[:, -1].float()  # (b, V)
        p = torch.softmax(logits, -1)
        tv += (0.5 * (p - p0).abs().sum(-1)).tolist()
        changed += int((p.argmax(-1) != p0.argmax()).sum())
        passes.add(part.shape[0])
    return Permutation(n=n, seed=seed, tv=tv, median_tv=float(torch.tensor(tv).median()), top_changed=changed / n)


@dataclass(frozen=True)
class Explanation:
    """Attention beside gradient importance for one token, and the permutation counterfactual.

    Lists run over the context tokens ``0 .. position-1``. ``attention``: the chosen head's
    weights (or the layer's mean over heads) at the query that predicts the token;
    ``input_x_gradient`` / ``integrated_gradients``: signed importances (nats);
    ``tau_*``: Kendall's tau-b of ``attention`` against ``|importance|`` (integrated gradients:
    over the last ``ig_positions`` tokens, the ones it moved);
    ``ig_gap``: ``sum(integrated_gradients) - (log_prob - log p(token | baseline))``, the
    integration error (0 with exact integration).
    """

    position: int
    token_id: int
    log_prob: float
    layer: int
    head: int | str
    attention: list[float]
    input_x_gradient: list[float]
    integrated_gradients: list[float]
    ig_steps: int
    ig_gap: float
    tau_input_x_gradient: float
    tau_integrated_gradients: float
    permutation: Permutation
    sentence: str
    ig_positions: int = 0   # context tokens integrated gradients moved (the last ones)

    def to_dict(self) -> dict:
        return asdict(self)


def summary_sentence(tau_ig: float, median_tv: float, top_changed: float) -> str:
    """One sentence saying what the numbers mean for this one token, without claiming more."""
    if math.isnan(tau_ig):
        agree = "The ranking cannot be compared (one of the two is constant)"
    elif abs(tau_ig) < 0.3:
        agree = f"Attention and gradient importance rank the context differently (tau {tau_ig:+.2f})"
    elif tau_ig > 0:
        agree = f"Attention and gradient importance broadly agree on the ranking (tau {tau_ig:+.2f})"
    else:
        agree = f"Attention ranks the context against gradient importance (tau {tau_ig:+.2f})"
    if median_tv < 0.05 and top_changed == 0:
        moved = "shuffling this head's weights barely moves the prediction, so it does not hinge on where this head looks"
    elif top_changed >= 0.5:
        moved = f"shuffling its weights changes the top token {top_changed:.0%} of the time, so this token depends on where it looks"
    else:
        moved = f"shuffling its weights moves the prediction by a median {median_tv:.2f} in total variation"
    return f"{agree}; {moved} (one token, one head of a deep model: other heads can compensate)."


def explain_token(
    model: Model, ids: Sequence[int], target: int = -1, layer: int = 0, head: int | str = 0, *,
    ig_steps: int = IG_STEPS, permutations: int = 32, seed: int = 0, ig_positions: int | None = IG_POSITIONS,
    progress=None, cancelled=None,
) -> Explanation:
    """Both of Jain and Wallace's tests for the token ``ids[target]`` (see the module docstring).

    Costs (:func:`explain_cost`): one forward and backward for input x gradient,
    ``ig_steps + 1`` more for integrated gradients (batched within :data:`IG_BUDGET_BYTES`),
    ``permutations`` forwards (batched), all without a KV cache. ``ig_positions``: the
    context tokens integrated gradients move (:func:`gradient_importance`'s ``positions``).
    ``progress(done, total)`` is called after each batch of passes; ``cancelled()`` is
    checked before each. The memory the passes took is handed back to the system after.

    Raises:
        ValueError: a target without context, a layer or head out of range, bad counts.
        ExplainCancelled: ``cancelled()`` turned true.
    """
    t = _check_target(model, ids, target)
    heads = _heads(model, head)
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.n_layers - 1}")
    passes = _Passes(explain_cost(model, t, ig_steps=ig_steps, permutations=permutations)["passes"],
                     progress, cancelled)
    try:
        passes.check()
        w, _ = _attention_row(model, list(ids[:t]), layer)  # (H, t)
        att = w[heads].mean(0).float().cpu()  # (t,)
        ixg, lp = gradient_importance(model, ids, t, method="input_x_gradient", _passes=passes)
        ig, base_lp = gradient_importance(model, ids, t, method="integrated_gradients", steps=ig_steps,
                                          positions=ig_positions, _passes=passes)
        perm = permutation_test(model, ids, t, layer, head, n=permutations, seed=seed, _passes=passes)
    finally:
        gc.collect()   # the passes' activations and gradients: back to the system, not kept
        trim_heap()
    moved = min(ig_positions, t - 1) if ig_positions else t - 1   # the tokens integrated gradients moved
    tau_x = kendall_tau(att, torch.tensor(ixg).abs())
    tau_ig = kendall_tau(att[-moved:], torch.tensor(ig[-moved:]).abs()) if moved >= 2 else float("nan")
    return Explanation(
        position=t, token_id=int(ids[t]), log_prob=lp, layer=layer, head=head, attention=att.tolist(),
        input_x_gradient=ixg, integrated_gradients=ig, ig_steps=ig_steps, ig_gap=sum(ig) - (lp - base_lp),
        tau_input_x_gradient=tau_x, tau_integrated_gradients=tau_ig, permutation=perm,
        sentence=summary_sentence(tau_ig, perm.median_tv, perm.top_changed),
        ig_positions=moved,
    )


def explain_cost(model: Model, tokens: int, *, ig_steps: int = IG_STEPS, permutations: int = 32) -> dict:
    """What :func:`explain_token` will do for ``tokens`` context tokens, said before it starts:
    ``passes`` (progress steps: forward-and-backward passes, and permutation forwards),
    ``token_passes`` (tokens through the model, a backward counted as two forwards: multiply by
    seconds per prefilled token for the time) and ``peak_bytes`` (what the largest batch of
    gradient passes keeps beyond the model, :func:`pass_bytes`)."""
    batch = ig_batch(model, tokens)
    backward = 2 + ig_steps   # input x gradient, the steps, the baseline's log-prob
    token_passes = tokens * (3 * backward + 1 + permutations + 1)   # + the attention row and p0
    return {"passes": backward + permutations, "token_passes": token_passes,
            "peak_bytes": pass_bytes(model, tokens) * min(batch, ig_steps), "batch": batch}


def reply_positions(model: Model, messages: Sequence[Message], system_prompt: str | None = None) -> tuple[list[int], range]:
    """The conversation's token ids (as the attention view builds them) and the positions
    of the last assistant reply's own tokens in it (empty when the last message is not a
    reply, or the reply is empty)."""
    msgs = ([Message("system", system_prompt)] if system_prompt else []) + list(messages)
    ids = encode_messages(model.tokenizer, msgs, add_generation_prompt=not msgs or msgs[-1].role != "assistant")
    if not msgs or msgs[-1].role != "assistant" or not msgs[-1].content:
        return ids, range(0)
    start = len(encode_messages(model.tokenizer, msgs[:-1], add_generation_prompt=True))
    n = len(model.encode(msgs[-1].content))
    return ids, range(start, min(start + n, len(ids)))
