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
   the default model, a 328-token chat's last reply token (Intel Xeon), moving all
   327 tokens left an error of -66.6 of a 3.9 change with 16 midpoint steps, 16 tokens
   -1.7 of 12.6 (13 %); 32 tokens with 8 Gauss-Legendre nodes 2.6 of 11.7 (22 %), with
   16 nodes -0.20 of 11.7 (1.7 %, inside the 10 % the panel accepts). Not on every chat: on
   a 305-token one (two turns about the KV cache, greedy), its last reply token, 16 nodes over
   32 tokens left 4.0 of 19.9 (20 %), over 16 tokens 3.8 of 21.4 (18 %), 32 nodes over 32
   tokens -3.0 of 19.9 (15 %): log p along that path is rough (-21.2 at 0, -15.6 at 0.2,
   -9.7 at 0.3, -12.4 at 0.5, -8.5 at 0.7, -1.4 at 0.8 and after), so steps converge slowly
   and the panel says the result is rough. The baseline is the padding token's embedding
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

The gradients: :mod:`runtime.insight.gradients`.
"""
from __future__ import annotations

import gc
import math
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
    pass_bytes,
)
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
    t = check_target(model, ids, target)
    heads = _heads(model, head)
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer} is outside 0..{model.config.n_layers - 1}")
    passes = Passes(explain_cost(model, t, ig_steps=ig_steps, permutations=permutations)["passes"],
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
