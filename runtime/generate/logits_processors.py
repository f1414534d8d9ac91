"""Per-reply logits processors (see :data:`runtime.generate.events.LogitsProcessor`): OpenAI's
frequency and presence penalties, and a recorder of log-probabilities.

Each is made for one reply and called before every sampling step with the reply's token
ids so far and the logits ``(V,)``; a reply that uses none pays nothing. Must not
import Qt.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["PenaltyProcessor", "LogprobsRecorder", "TokenLogprob"]


class PenaltyProcessor:
    """OpenAI's frequency and presence penalties over the reply's tokens so far.

    ``logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``, where
    ``c[j]`` counts token ``j`` in the reply (source: OpenAI's API reference, "Frequency
    and presence penalties"). The counts are one tensor ``(V,)`` float32 on the logits'
    device, allocated on the first step and updated with the new tokens only.

    Raises:
        ValueError: a penalty outside [-2, 2] (OpenAI's range).
    """

    def __init__(self, frequency_penalty: float = 0.0, presence_penalty: float = 0.0):
        for name, v in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {v!r}")
        self.frequency, self.presence = float(frequency_penalty), float(presence_penalty)
        self._counts: torch.Tensor | None = None
        self._seen = 0

    @torch.inference_mode()
    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if self._counts is None or self._counts.device != logits.device:
            self._counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
            self._seen = 0
        new = generated[self._seen:]
        if new:
            ids = torch.tensor(list(new), dtype=torch.long, device=logits.device)
            self._counts.index_add_(0, ids, torch.ones(len(new), device=logits.device))
            self._seen = len(generated)
        penalty = self._counts * self.frequency + (self._counts > 0).float() * self.presence
        return logits.sub_(penalty.to(logits.dtype))


@dataclass
class TokenLogprob:
    """One sampled token: its id, its log-probability (natural log) and the most likely
    alternatives at that step as ``(id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class LogprobsRecorder:
    """Records the log-probability of each sampled token and the ``top`` most likely ones.

    The distribution is the one sampled from at temperature 1: the model's logits after
    the processors placed before this one (penalties, a grammar's mask), log-softmaxed
    in float32. A step's token is known only at the next call, so :meth:`finish` takes
    the reply's token ids to close the last step.

    Args:
        top: alternatives per token, 0-20 (OpenAI's ``top_logprobs``).
    """

    def __init__(self, top: int = 0):
        if not 0 <= top <= 20:
            raise ValueError(f"top_logprobs must be between 0 and 20, got {top!r}")
        self.top = top
        self.tokens: list[TokenLogprob] = []
        self._pending: torch.Tensor | None = None  # (V,) float32 log-probs of the open step

    @torch.inference_mode()
    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self._close(generated)
        self._pending = torch.log_softmax(logits.float(), dim=-1)
        return logits

    def finish(self, token_ids: Sequence[int]) -> list[TokenLogprob]:
        """Close the last step with the reply's sampled ids; returns every token's entry."""
        self._close(token_ids)
        return self.tokens

    def _close(self, generated: Sequence[int]) -> None:
        if self._pending is None or len(generated) <= len(self.tokens):
            return
        row, token = self._pending, int(generated[len(self.tokens)])
        top: list[tuple[int, float]] = []
        if self.top:
            values, ids = torch.topk(row, self.top)
            top = list(zip(ids.tolist(), values.tolist()))
        self.tokens.append(TokenLogprob(token, float(row[token]), top))
        self._pending = None
