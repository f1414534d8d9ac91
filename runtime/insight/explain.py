"""Does attention explain this token? Jain and Wallace's two tests on our decoder.

Must not import Qt. Jain and Wallace 2019, "Attention is not Explanation" (NAACL),
ask two questions of the attention weights behind a prediction:

1. Do they rank the inputs as a gradient-based importance does? Here: for the token at
   position ``t`` (its log-probability, predicted at query position ``t - 1``), each
   context token ``j < t`` gets an importance from the gradient on its embedding
   ``x_j``: input x gradient ``sum_c x_jc * d logp / d x_jc`` (Shrikumar et al. 2016),
   and integrated gradients (Sundararajan et al. 2017) along the straight path from a
   baseline ``b``, ``sum_c (x - b)_jc * integral_0^1 g_jc(b + a (x - b)) da``; their sum
   is ``logp(x) - logp(b)`` (completeness). Only the last ``positions`` context tokens move
   (:data:`IG_POSITIONS`; the others keep their embeddings, are computed once as a frozen
   prefix, and get importance 0), and tau is taken over them. The integral: the adaptive
   rule of :mod:`runtime.insight.integrated` (Simpson panels halved where their known error
   is largest, until the error is within 5 %; at most :data:`IG_STEPS` passes); fixed
   Gauss-Legendre or midpoint nodes as options (:func:`ig_nodes`). Fixed nodes were the
   default before and missed the bound: on the default model a 305-token chat's last reply
   token (two turns about the KV cache, greedy), 16 Gauss-Legendre nodes over 32 tokens left
   4.0 of a 19.9 change (20 %), 32 nodes 15 %: log p along that path turns sharply (-13.4 at
   0.665, -8.5 at 0.70, -2.7 at 0.74). The adaptive rule over 64 tokens left 0.1-2.6 % on
   every chat measured (:mod:`runtime.insight.integrated`'s figures);
   the panel still says when a result is outside its 10 %. The baseline is the padding token's embedding
   (else the end-of-sequence token's) at every position but the first, which keeps its
   own: a real input. The common all-zero embedding is not one for RMSNorm models
   without biases (SmolLM, Llama): zero stays zero through every block and the final
   norm turns any small multiple of ``x`` into a full-size state, so ``logp`` jumps at
   0 and no step count integrates it. The first token is where most heads rest (the
   attention sink, Xiao et al. 2023); moving it moves the whole model's largest
   activations, and the path then needs many more steps (on the default model, 32
   steps left a 64 % error with it moved and 20 % with it kept, for one 12-token
   example). It gets importance 0, as does any context token that is the baseline token.
   ``Explanation.ig_gap`` reports the error: raise ``steps`` when it is large. Kendall's tau-b compares the ranking of the
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
   this token, not that attention in general does not. Only the last query changes, so
   the tokens before it are a frozen prefix and each permutation is a one-token pass.

The gradients: :mod:`runtime.insight.gradients`.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from runtime.device import trim_heap
from runtime.generate.chat_format import Message, encode_messages
from runtime.insight.ablation import edited
from runtime.insight.attention_view import layer_qkv
from runtime.insight.gradients import (
    IG_BUDGET_BYTES,
    ExplainCancelled,
    Passes,
    baseline_token,
    check_target,
    gradient_importance,
    ig_batch,
    integrated_gradients,
    moved_tokens,
    pass_bytes,
    widened_bytes,
)
from runtime.insight.integrated import frozen_prefix
from runtime.insight.probe import AttentionCapture
from runtime.loader.model import Model
from runtime.model.attention import attention_reference
from runtime.model.quant_layers import widened_for_gradients

__all__ = ["ExplainCancelled", "Explanation", "GRADIENT_PASS_FORWARDS", "IG_BUDGET_BYTES", "IG_POSITIONS", "IG_STEPS",
           "IG_TYPICAL_STEPS", "Permutation", "STEP_FORWARDS",
           "baseline_token", "explain_cost", "explain_rate", "explain_token", "explain_work", "gradient_importance", "ig_batch", "kendall_tau",
           "pass_bytes", "permutation_test", "reply_positions", "summary_sentence"]

#: Explain's defaults: integrated gradients in at most this many gradient passes (the adaptive
#: rule stops at its tolerance), moving the last this many context tokens (measured:
#: :mod:`runtime.insight.integrated`).
IG_STEPS = 97
IG_POSITIONS: int | None = 64


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
    t = check_target(model, ids, target)
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.n_layers - 1}")
    heads = _heads(model, head)
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    passes = _passes or Passes(n, progress, cancelled)
    ctx = list(ids[:t])
    w, v = _attention_row(model, ctx, layer)  # (H, t), (Hkv, t, D)
    group = model.config.n_heads // model.config.n_kv_heads
    # Only the last query's outputs change: the tokens before it are one frozen prefix, and each
    # batch runs the last token alone. Row 0 of every batch is left as it is: p0 comes from the
    # same products as the permuted rows.
    prefix = frozen_prefix(model, torch.tensor([ctx[:-1]], device=model.device))
    last = torch.tensor([ctx[-1:]], device=model.device)
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(t, generator=g) for _ in range(n)]
    # The permuted heads' outputs at the last query: (n, k, D) = permuted weights @ values.
    outs = torch.stack([
        torch.stack([w[h][p.to(w.device)] @ v[h // group].float() for h in heads]) for p in perms
    ])
    idx = torch.tensor(heads)
    tv, changed, p0 = [], 0, None
    for i in range(0, n, chunk):
        passes.check()
        part = outs[i:i + chunk]  # (b, k, D)

        def swap(_layer: int, y: torch.Tensor, part=part) -> torch.Tensor:
            y = y.clone()  # (1 + b, H, 1, D)
            y[1:, idx.to(y.device), -1] = part.to(y)
            return y

        with edited(model, swap, [layer]), torch.inference_mode():
            logits = model.decoder(last.expand(1 + part.shape[0], -1), prefix, last_only=True)[:, -1].float()
        p = torch.softmax(logits, -1)  # (1 + b, V)
        p0 = p[0] if p0 is None else p0
        tv += (0.5 * (p[1:] - p0).abs().sum(-1)).tolist()
        changed += int((p[1:].argmax(-1) != p0.argmax()).sum())
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
    ``ig_gap``: ``sum(integrated_gradients) - ig_change``, the integration error (0 with exact
    integration), where ``ig_change`` is ``log p(token) - log p(token | baseline)`` on the path;
    ``ig_steps``: the gradient passes integrated gradients ran.
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
    ig_rule: str = "adaptive"   # where the steps went (runtime.insight.gradients.IG_RULES)
    ig_change: float = 0.0   # log p(token) - log p(token | baseline) along the path (nats)

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
    ig_rule: str = "adaptive", progress=None, cancelled=None,
) -> Explanation:
    """Both of Jain and Wallace's tests for the token ``ids[target]`` (see the module docstring).

    Costs (:func:`explain_cost`): one forward and backward over the context for input x
    gradient; integrated gradients over the last ``ig_positions`` tokens after a frozen
    prefix (:func:`~runtime.insight.gradients.integrated_gradients`, ``ig_rule``: at most
    ``ig_steps`` passes, batched within :data:`IG_BUDGET_BYTES`); ``permutations`` one-token
    passes after a frozen prefix (batched). ``progress(done, total)`` is called after each
    batch of passes; ``cancelled()`` is checked before each. The memory the passes took is
    handed back to the system after.

    Raises:
        ValueError: a target without context, a layer or head out of range, bad counts or rule.
        ExplainCancelled: ``cancelled()`` turned true.
    """
    t = check_target(model, ids, target)
    heads = _heads(model, head)
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.n_layers - 1}")
    cost = explain_cost(model, t, ig_steps=ig_steps, permutations=permutations, ig_positions=ig_positions,
                        ig_rule=ig_rule)
    passes = Passes(cost["passes"], progress, cancelled)
    try:
        passes.check()
        w, _ = _attention_row(model, list(ids[:t]), layer)  # (H, t)
        att = w[heads].mean(0).float().cpu()  # (t,)
        with widened_for_gradients(model.decoder):   # a quantized matrix widened once, not per pass
            ixg, lp = gradient_importance(model, ids, t, method="input_x_gradient", _passes=passes)
            ig = integrated_gradients(model, ids, t, steps=ig_steps, positions=ig_positions, rule=ig_rule,
                                      _passes=passes)
        perm = permutation_test(model, ids, t, layer, head, n=permutations, seed=seed, _passes=passes)
    finally:
        gc.collect()   # the passes' activations and gradients: back to the system, not kept
        trim_heap()
    moved = ig.moved
    tau_x = kendall_tau(att, torch.tensor(ixg).abs())
    tau_ig = (kendall_tau(att[-moved:], torch.tensor(ig.importances[-moved:]).abs()) if moved >= 2
              else float("nan"))
    return Explanation(
        position=t, token_id=int(ids[t]), log_prob=lp, layer=layer, head=head, attention=att.tolist(),
        input_x_gradient=ixg, integrated_gradients=ig.importances, ig_steps=ig.steps, ig_gap=ig.gap,
        tau_input_x_gradient=tau_x, tau_integrated_gradients=tau_ig, permutation=perm,
        sentence=summary_sentence(tau_ig, perm.median_tv, perm.top_changed),
        ig_positions=moved, ig_rule=ig_rule, ig_change=ig.log_prob - ig.base_log_prob,
    )


#: What a token costs in each kind of pass, in no-gradient forwards of one token (the unit the
#: desktop times), measured on the default model over a 302-token context (Intel Xeon, quiet):
#: the forward and backward over the whole context took 2.4 forwards per token, a moving token
#: in a batch of 4-5 integrated-gradient steps 1.3 (after a frozen prefix; weights widened once).
GRADIENT_PASS_FORWARDS = 2.5
STEP_FORWARDS = 1.5
#: Gradient passes the adaptive rule typically ran (43-73 on the default model's chats,
#: :mod:`runtime.insight.integrated`): the time said first; the most is said beside it.
IG_TYPICAL_STEPS = 60


def explain_rate(model: Model, ids: Sequence[int], target: int = -1, *, clock=time.perf_counter) -> float:
    """This machine's seconds per no-gradient forward of one token (the unit of
    :func:`explain_work`), timed from one input x gradient pass over ``ids[:target]`` in the
    weights Explain's passes use (quantized matrices widened, :func:`widened_for_gradients`).
    A no-gradient forward through the quantized kernels was the clock before, and gradient
    passes in widened weights cost a machine-dependent multiple of it: the time said first was
    short (AMD EPYC Zen 4, 2 vCPUs shared, the default model: a 284-token chat 26 s said and
    50 s taken, a 230-token one 54 s and 62 s; a figure from a busy machine, not a speed).

    Raises:
        ValueError: a target without context.
    """
    t = check_target(model, ids, target)
    try:
        with widened_for_gradients(model.decoder):
            started = clock()
            gradient_importance(model, ids, t, method="input_x_gradient")
            took = clock() - started
    finally:
        gc.collect()
        trim_heap()
    return took / (GRADIENT_PASS_FORWARDS * max(1, t))


def explain_work(tokens: int, *, permutations: int = 32,
                 ig_positions: int | None = IG_POSITIONS) -> tuple[float, float, float]:
    """What each pass of :func:`explain_token` costs, in no-gradient forwards of one token
    (:data:`GRADIENT_PASS_FORWARDS`, :data:`STEP_FORWARDS`): ``(first, step, permutation)``:
    the input x gradient pass with the attention row and the frozen prefix, one
    integrated-gradient step, one permutation row (its share of the permutations' prefix)."""
    moved = moved_tokens(tokens, ig_positions)
    first = GRADIENT_PASS_FORWARDS * tokens + tokens + STEP_FORWARDS * (tokens - moved)
    return first, STEP_FORWARDS * moved, (tokens + permutations) / max(1, permutations)


def explain_cost(model: Model, tokens: int, *, ig_steps: int = IG_STEPS, permutations: int = 32,
                 ig_positions: int | None = IG_POSITIONS, ig_rule: str = "adaptive") -> dict:
    """What :func:`explain_token` will do for ``tokens`` context tokens, said before it starts.

    Returns a dict: ``passes`` (progress steps: gradient passes, at most, and permutation rows),
    ``token_passes`` (the work in no-gradient forwards of one token, :func:`explain_work`:
    multiply by seconds per forwarded token for the time; the most steps),
    ``typical_token_passes`` (the same with :data:`IG_TYPICAL_STEPS` for the adaptive rule),
    ``peak_bytes`` (the most the passes keep beyond the model at once: quantized matrices
    widened once, :func:`~runtime.insight.gradients.widened_bytes`, and the input x gradient pass
    over every token or a batch of integrated-gradient steps, :func:`pass_bytes`) and ``batch``
    (steps per batch within :data:`IG_BUDGET_BYTES`)."""
    moved = moved_tokens(tokens, ig_positions)
    batch = ig_batch(model, moved, keys=tokens)
    ig_passes = ig_steps + (ig_rule != "adaptive")
    typical = min(ig_passes, IG_TYPICAL_STEPS) if ig_rule == "adaptive" else ig_passes
    first, step, perm = explain_work(tokens, permutations=permutations, ig_positions=ig_positions)
    peak = widened_bytes(model) + max(pass_bytes(model, tokens), pass_bytes(model, moved, tokens) * min(batch, ig_passes))
    return {"passes": 1 + ig_passes + permutations, "token_passes": first + step * ig_passes + perm * permutations,
            "typical_token_passes": first + step * typical + perm * permutations, "peak_bytes": peak, "batch": batch}


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
