"""Knock attention heads out, and Olsson et al.'s induction-head test on a model.

Must not import Qt. A :class:`HeadAblation` edits the heads' outputs inside our
attention (``Attention.head_edit`` in :mod:`runtime.model.attention`, ``None`` unless one is
active: one attribute check per layer, nothing else, when unused). Each ablated head's
output ``(B, T, D)``, taken before the output projection ``o_proj`` mixes the heads, is

- ``"zero"``: replaced by zeros;
- ``"mean"``: replaced by its mean over every sequence and position of the same
  forward (the head then still adds its average contribution, but nothing that
  depends on the token it is at: mean-ablation, as in Olsson et al. 2022's
  ablations and Wang et al. 2022's "Interpretability in the Wild").

The induction preset follows Olsson et al. 2022, "In-context Learning and Induction
Heads": random ordinary tokens repeated twice after BOS (:func:`runtime.insight.probe.repeated_random_tokens`);
a model with induction heads predicts the second copy far better than the first.
Knocking out the heads with the highest induction score (the head atlas,
:func:`runtime.insight.probe.head_scores`) should raise the loss on the second copy far more
than knocking out as many randomly drawn heads.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator

import torch

from runtime.insight.probe import HeadScores, head_scores, repeated_random_tokens
from runtime.loader.model import Model

__all__ = ["ABLATION_MODES", "HeadAblation", "InductionAblation", "ablated", "copy_losses", "edited",
           "induction_ablation", "parse_heads", "top_and_probs"]

#: ``"zero"``: the head's output becomes 0; ``"mean"``: its mean over the forward's tokens.
ABLATION_MODES = ("zero", "mean")

#: Called with ``(layer, y)``, y the heads' outputs ``(B, H, T, D)`` before ``o_proj``;
#: returns the tensor to use instead (same shape and dtype).
HeadEdit = Callable[[int, torch.Tensor], torch.Tensor]


def _check_heads(model: Model, heads: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    L, H = model.config.n_layers, model.config.n_heads
    out = sorted({(int(l), int(h)) for l, h in heads})
    for l, h in out:
        if not (0 <= l < L and 0 <= h < H):
            raise ValueError(f"head L{l}.H{h} is outside layers 0..{L - 1} and heads 0..{H - 1}")
    return out


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"3.1 5.0"`` or ``"L3.H1, L5.H0"`` -> ``[(3, 1), (5, 0)]`` (zero-based layer.head).

    Raises:
        ValueError: a part that is not ``layer.head`` with two whole numbers.
    """
    out = []
    for part in text.replace(",", " ").split():
        p = part.upper().replace("L", "").replace("H", "")
        layer, dot, head = p.partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise ValueError(f"{part!r} is not a head; write layer.head, e.g. 3.1 (zero-based)")
        out.append((int(layer), int(head)))
    return out


class HeadAblation:
    """Knock out ``heads`` (zero-based ``(layer, head)`` pairs) in ``mode``; a ``HeadEdit``.

    Use it through :func:`ablated`. Only the listed heads' slices change; every other
    head's output passes through untouched (the same tensor when a layer has none).

    Raises:
        ValueError: a mode not in :data:`ABLATION_MODES`.
    """

    def __init__(self, heads: Iterable[tuple[int, int]], mode: str = "zero"):
        if mode not in ABLATION_MODES:
            raise ValueError(f"unknown ablation mode {mode!r}; use one of {', '.join(ABLATION_MODES)}")
        self.mode = mode
        self.heads = sorted({(int(l), int(h)) for l, h in heads})
        self.by_layer: dict[int, list[int]] = {}
        for l, h in self.heads:
            self.by_layer.setdefault(l, []).append(h)

    def __call__(self, layer: int, y: torch.Tensor) -> torch.Tensor:
        heads = self.by_layer.get(layer)
        if not heads:
            return y
        y = y.clone()  # (B, H, T, D)
        idx = torch.tensor(heads, device=y.device)
        if self.mode == "zero":
            y[:, idx] = 0
        else:
            y[:, idx] = y[:, idx].mean(dim=(0, 2), keepdim=True)  # (1, k, 1, D): over sequences and positions
        return y


@contextlib.contextmanager
def edited(model: Model, edit: HeadEdit, layers: Iterable[int] | None = None) -> Iterator[None]:
    """Set ``edit`` as ``head_edit`` on ``layers`` (all when None) while inside; restores ``None``.

    Raises:
        RuntimeError: another edit is already active on one of those layers.
    """
    blocks = model.decoder.blocks
    chosen = range(len(blocks)) if layers is None else sorted(set(layers))
    attns = [blocks[i].attn for i in chosen]
    if any(a.head_edit is not None for a in attns):
        raise RuntimeError("another head edit is active on this model; finish it first")
    for a in attns:
        a.head_edit = edit
    try:
        yield
    finally:
        for a in attns:
            a.head_edit = None


@contextlib.contextmanager
def ablated(model: Model, heads: Iterable[tuple[int, int]], mode: str = "zero") -> Iterator[HeadAblation]:
    """Knock out ``heads`` while inside (an empty list changes nothing).

    Raises:
        ValueError: a head outside the model, an unknown mode.
    """
    ab = HeadAblation(_check_heads(model, heads), mode)
    with edited(model, ab, ab.by_layer):
        yield ab


def top_and_probs(model: Model, ids: list[int], target: int, top: int = 5) -> dict:
    """The next-token distribution at position ``target - 1`` (the one that predicts token ``target``).

    Returns:
        ``{"prob": p(ids[target]), "top": [(token_id, prob), ...]}`` (``top`` most likely, probabilities in [0, 1]).
    """
    with torch.inference_mode():
        logits = model.logits(ids[:target], last_only=True)[0, -1]  # (V,)
    p = torch.softmax(logits.float(), dim=-1)
    vals, idx = p.topk(top)
    return {"prob": float(p[ids[target]]), "top": [(int(i), float(v)) for i, v in zip(idx, vals)]}


def copy_losses(model: Model, ids: torch.Tensor, repeat_len: int) -> tuple[float, float]:
    """Mean next-token loss (nats) on the first and on the second copy of ``ids``.

    Args:
        ids: ``(B, 1 + 2N)`` BOS then N random tokens twice (:func:`runtime.insight.probe.repeated_random_tokens`).
        repeat_len: N.

    Returns:
        (first copy: its N tokens, each predicted from what precedes it; second copy:
        its tokens 2..N, the ones an induction head can predict: the first token of the
        copy follows the end of the first copy and is not predictable from context).
    """
    with torch.inference_mode():
        logits = model.logits(ids)  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V): position p predicts p + 1
    nll = -logp.gather(-1, ids[:, 1:, None].to(logp.device))[..., 0]  # (B, T-1)
    N = repeat_len
    first = nll[:, 0:N]          # targets 1..N
    second = nll[:, N + 1:2 * N]  # targets N+2..2N
    return float(first.mean()), float(second.mean())


@dataclass(frozen=True)
class InductionAblation:
    """Olsson et al.'s induction test on a model: losses in nats per token (mean cross-entropy).

    ``*_first`` is the loss on the first copy (random tokens: unpredictable, about
    ``ln(vocab)`` for a model that has not seen them); ``*_second`` on the second copy's
    tokens 2..N. ``random_*`` hold one value per control draw (``controls`` draws of as
    many heads as ``heads``, none of them among ``heads``).
    """

    heads: list[tuple[int, int]]
    random_heads: list[list[tuple[int, int]]]
    mode: str
    repeat_len: int
    batch: int
    seed: int
    baseline_first: float
    baseline_second: float
    induction_first: float
    induction_second: float
    random_first: list[float]
    random_second: list[float]

    def to_dict(self) -> dict:
        return asdict(self)


def induction_ablation(
    model: Model,
    *,
    scores: HeadScores | None = None,
    n_heads: int = 5,
    mode: str = "mean",
    repeat_len: int = 50,
    batch: int = 4,
    seed: int = 1,
    controls: int = 3,
) -> InductionAblation:
    """Ablate the ``n_heads`` best induction heads, then ``controls`` random sets as large.

    Args:
        scores: the head atlas to rank by (default: :func:`runtime.insight.probe.head_scores` with
            its defaults, measured on seed 0: keep ``seed`` different so the heads are
            not chosen on the tokens they are tested on).
        n_heads: how many heads to knock out.
        mode: ``"zero"`` or ``"mean"`` (:class:`HeadAblation`).
        repeat_len, batch, seed: the test tokens (:func:`runtime.insight.probe.repeated_random_tokens`).
        controls: random head sets drawn (``random.Random(seed + i)`` for draw ``i``).

    Raises:
        ValueError: ``n_heads`` outside 1..half the model's heads, ``repeat_len`` below 2,
            more tokens than the model's context, an unknown mode.
    """
    L, H = model.config.n_layers, model.config.n_heads
    if not 1 <= n_heads <= L * H // 2:
        raise ValueError(f"n_heads {n_heads} is outside 1..{L * H // 2} (half of the model's {L * H} heads)")
    if repeat_len < 2 or 1 + 2 * repeat_len > model.config.max_position_embeddings:
        raise ValueError(f"repeat_len {repeat_len} must be at least 2 and fit twice in the model's context")
    if mode not in ABLATION_MODES:
        raise ValueError(f"unknown ablation mode {mode!r}; use one of {', '.join(ABLATION_MODES)}")
    scores = scores if scores is not None else head_scores(model)
    top = sorted((l, h) for l, h, _ in scores.top("induction", n_heads))
    ids = repeated_random_tokens(model, repeat_len, batch, seed)
    base = copy_losses(model, ids, repeat_len)
    with ablated(model, top, mode):
        ind = copy_losses(model, ids, repeat_len)
    others = [(l, h) for l in range(L) for h in range(H) if (l, h) not in set(top)]
    draws, rnd = [], []
    for i in range(controls):
        pick = sorted(random.Random(seed + i).sample(others, n_heads))
        with ablated(model, pick, mode):
            rnd.append(copy_losses(model, ids, repeat_len))
        draws.append(pick)
    return InductionAblation(
        heads=top, random_heads=draws, mode=mode, repeat_len=repeat_len, batch=batch, seed=seed,
        baseline_first=base[0], baseline_second=base[1], induction_first=ind[0], induction_second=ind[1],
        random_first=[r[0] for r in rnd], random_second=[r[1] for r in rnd],
    )
