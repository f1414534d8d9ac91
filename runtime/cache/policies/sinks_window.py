"""StreamingLLM (Xiao et al. 2023, arXiv:2309.17453): the first tokens as attention sinks, then the newest.

Must not import Qt, the decoder or the generator. One idea, two uses:

- the ``sinks-window`` cache policy (:class:`SinksWindow`): keeps the first ``sink_tokens``
  positions and the newest ones; the kept keys are not re-rotated, later queries use their true
  positions (kvpress's ``StreamingLLMPress`` without ``KeyRerotationPress``);
- the ``rolling`` overflow policy (:func:`rolling_span`): when the context is full, the span
  after the sinks to cut so new tokens fit; the cache renumbers the positions after it
  (:meth:`runtime.cache.kv_cache.KVCache.remove_span`) and the decoder re-rotates the moved
  keys, so the model reads a contiguous context of at most ``limit`` positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from runtime.cache.policies.base import LayerObservation, Policy, PolicyParams


@dataclass(frozen=True)
class SinksWindow(Policy):
    """``sinks-window``: ``inf`` for the first ``sink_tokens`` positions, else the position
    (newer = higher): the sinks, then the newest tokens."""

    name: ClassVar[str] = "sinks-window"
    sink_tokens: int = 4

    @classmethod
    def from_params(cls, params: PolicyParams) -> "SinksWindow":
        return cls(params.sink_tokens)

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        pos = obs.positions.float()
        return torch.where(obs.positions < self.sink_tokens, torch.full_like(pos, float("inf")), pos)


def rolling_window(limit: int, sink_tokens: int) -> int:
    """Tokens of the rolling window after the sinks (at least 1)."""
    return limit - min(sink_tokens, limit - 1)


def rolling_span(length: int, n_new: int, *, limit: int, sink_tokens: int) -> tuple[int, int] | None:
    """Positions ``[start, end)`` to remove so ``n_new`` more tokens fit ``limit``, or ``None`` if they fit.

    Removes at least a quarter of the window at once, so the shift and re-rotation of the kept
    keys happen once every ~window/4 decode steps instead of on every step.

    Raises:
        ValueError: ``n_new`` is larger than the window (no cut can make room).
    """
    if length + n_new <= limit:
        return None
    sink = limit - rolling_window(limit, sink_tokens)
    window = limit - sink
    if n_new > window:
        raise ValueError(f"{n_new} new tokens do not fit a rolling window of {window}")
    n_cut = min(max(length + n_new - limit, window // 4), length - sink)
    return sink, sink + n_cut
