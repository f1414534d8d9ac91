"""Attention capture for the attention view, and head scores (previous-token, induction).

Must not import Qt. Capture costs nothing unless asked: the decoder checks one
``observer`` attribute per layer, and only while a :class:`AttentionCapture` is
active does attention take the reference path that returns its weights.

Head scores follow the standard probe of Olsson et al. 2022, "In-context Learning
and Induction Heads" (as in TransformerLens): a sequence of random tokens repeated
twice, after a BOS token.

- induction score of a head: the mean attention from each token of the second copy
  to the token just after its first occurrence;
- previous-token score: the mean attention from each token to the token just before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.loader.model import Model


class AttentionCapture:
    """Collect attention weights of every layer while active (a context manager).

    Args:
        model: the model whose decoder is observed.
        layers: the layers to keep (None: all).
        last_row_only: keep only the last query row of each call, ``(B, H, Tk)``: the
            newest token's attention, all a live view needs (a prefill chunk of 256
            queries then stores one row, not 256).

    Attributes:
        weights: ``{layer: tensor}`` float32 on the CPU, the last call's: ``(B, H, Tq, Tk)``,
            or ``(B, H, Tk)`` with ``last_row_only``.
        version: bumped at every observed layer (tells a reader that new weights came).
    """

    def __init__(self, model: Model, layers: set[int] | None = None, *, last_row_only: bool = False):
        self.model = model
        self.layers = layers
        self.last_row_only = last_row_only
        self.weights: dict[int, torch.Tensor] = {}
        self.version = 0

    def _observe(self, layer: int, weights: torch.Tensor) -> None:
        if self.layers is None or layer in self.layers:
            w = weights[:, :, -1] if self.last_row_only else weights  # (B, H, Tk) or (B, H, Tq, Tk)
            self.weights[layer] = w.detach().float().cpu()
            self.version += 1

    def __call__(self, layer: int, weights: torch.Tensor) -> None:
        self._observe(layer, weights)

    def __enter__(self) -> "AttentionCapture":
        # The capture is the decoder's "weights" hook; with ``last_row_only`` attention keeps
        # its fast path and runs the formula for the newest row only.
        self.model.decoder.hooks.replace("weights", self, last_row_only=self.last_row_only)
        return self

    def __exit__(self, *exc) -> None:
        self.model.decoder.hooks.replace("weights", None)


@dataclass(frozen=True)
class HeadScores:
    """Per-head scores, ``[layer][head]`` (zero-based), each in [0, 1]."""

    induction: list[list[float]]
    previous_token: list[list[float]]

    def to_dict(self) -> dict:
        return {"induction": self.induction, "previous_token": self.previous_token}

    def top(self, kind: str, n: int = 5) -> list[tuple[int, int, float]]:
        """The ``n`` best heads for ``kind`` ("induction" or "previous_token"): (layer, head, score)."""
        grid = getattr(self, kind)
        flat = [(l, h, s) for l, row in enumerate(grid) for h, s in enumerate(row)]
        return sorted(flat, key=lambda x: -x[2])[:n]


def scores_from_weights(weights: torch.Tensor, repeat_len: int, offset: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Induction and previous-token scores from attention on a repeated sequence.

    Args:
        weights: ``(L, B, H, T, T)`` attention weights with ``T = offset + 2 * repeat_len``
            (``offset`` tokens, e.g. BOS, before the first copy).
        repeat_len: ``N``, the length of each copy.

    Returns:
        (induction ``(L, H)``, previous_token ``(L, H)``), means over batch and positions.
    """
    L, B, H, T, _ = weights.shape
    if T != offset + 2 * repeat_len:
        raise ValueError(f"T={T} is not {offset} + 2 x {repeat_len}")
    # Second copy: query q attends to key q - N + 1 (the token after the first occurrence).
    q = torch.arange(offset + repeat_len, T)
    induction = weights[..., q, q - repeat_len + 1].mean(dim=(1, 3))  # (L, H)
    qp = torch.arange(1, T)
    previous = weights[..., qp, qp - 1].mean(dim=(1, 3))  # (L, H)
    return induction, previous


def repeated_random_tokens(model: Model, repeat_len: int = 50, batch: int = 4, seed: int = 0) -> torch.Tensor:
    """``(batch, 1 + 2 * repeat_len)`` ids: BOS (or the first special token), then random
    ordinary tokens, repeated. Special tokens are never drawn."""
    g = torch.Generator().manual_seed(seed)
    special = set(getattr(model.tokenizer, "all_special_ids", []) or [])
    vocab = model.config.vocab_size
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    draw = allowed[torch.randint(len(allowed), (batch, repeat_len), generator=g)]
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else int(allowed[0])
    first = torch.full((batch, 1), bos, dtype=torch.long)
    return torch.cat([first, draw, draw], dim=1)


def head_scores(model: Model, *, repeat_len: int = 50, batch: int = 4, seed: int = 0) -> HeadScores:
    """Measure every head's induction and previous-token score on the default probe.

    Returns:
        :class:`HeadScores` with ``[n_layers][n_heads]`` lists.
    """
    ids = repeated_random_tokens(model, repeat_len, batch, seed)
    with AttentionCapture(model) as cap:
        model.logits(ids, last_only=True)  # the weights are wanted, not (B, T, V) logits
    stacked = torch.stack([cap.weights[i] for i in range(model.config.n_layers)])  # (L, B, H, T, T)
    induction, previous = scores_from_weights(stacked, repeat_len)
    return HeadScores(induction=induction.tolist(), previous_token=previous.tolist())
