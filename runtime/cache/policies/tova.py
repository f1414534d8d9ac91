"""TOVA (Oren et al. 2024, arXiv:2401.06104): what the newest query looks at.

Must not import Qt, the decoder or the generator. The newest query's attention averaged over
all heads of the layer, so every KV head keeps the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from runtime.cache.policies.base import LayerObservation, Policy


@dataclass(frozen=True)
class TOVA(Policy):
    """``tova``: the newest query's attention, averaged over the layer's heads, the same for each KV head."""

    name: ClassVar[str] = "tova"
    needs: ClassVar[frozenset[str]] = frozenset({"recent_attention"})

    @property
    def queries(self) -> int:
        return 1

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        att = self._need(obs.recent_attention, "recent_attention")  # (B, H, W, T)
        last = att[:, :, -1].float().mean(dim=1, keepdim=True)  # (B, 1, T)
        return last.expand(-1, obs.positions.shape[1], -1)
