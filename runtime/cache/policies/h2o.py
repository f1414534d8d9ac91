"""H2O, the Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048).

Must not import Qt, the decoder or the generator. Keeps the keys that have drawn the most
attention from every query since they were cached (the "heavy hitters"), plus the newest
``recent`` share of the budget (the paper's recent window; its experiments split the budget
half and half).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from runtime.cache.policies.base import LayerObservation, Policy, PolicyParams, boost_newest


@dataclass(frozen=True)
class H2O(Policy):
    """``h2o``: the accumulated attention, with the newest ``round(recent * n_keep)`` slots first."""

    name: ClassVar[str] = "h2o"
    needs: ClassVar[frozenset[str]] = frozenset({"accumulated"})
    recent: float = 0.5

    @classmethod
    def from_params(cls, params: PolicyParams) -> "H2O":
        return cls(params.h2o_recent)

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        acc = self._need(obs.accumulated, "accumulated")
        return boost_newest(acc.float(), obs.positions, int(round(self.recent * n_keep)))
