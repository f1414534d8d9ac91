"""Key norm (Devoto et al. 2024, arXiv:2406.11430): low-norm keys draw high attention.

Must not import Qt, the decoder or the generator. Needs no attention at all: the keys' L2
norm, the lowest kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from runtime.cache.policies.base import LayerObservation, Policy


@dataclass(frozen=True)
class KeyNorm(Policy):
    """``key-norm``: minus each key's L2 norm."""

    name: ClassVar[str] = "key-norm"
    needs: ClassVar[frozenset[str]] = frozenset({"keys"})

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        return -self._need(obs.keys, "keys").float().norm(dim=-1)
