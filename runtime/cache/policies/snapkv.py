"""SnapKV (Li et al. 2024, arXiv:2404.14469): what the newest queries (at the end of a prompt:
the question) look at.

Must not import Qt, the decoder or the generator. The attention of the newest ``window``
queries, averaged over those queries, smoothed along the slots by an average pool of
``kernel`` (zero padding counted, as kvpress does) and averaged over the query heads of each
KV head; the window's own tokens are kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from runtime.cache.policies.base import LayerObservation, Policy, PolicyParams, boost_newest


@dataclass(frozen=True)
class SnapKV(Policy):
    """``snapkv``: the observation window's pooled attention, the window itself first."""

    name: ClassVar[str] = "snapkv"
    needs: ClassVar[frozenset[str]] = frozenset({"recent_attention"})
    window: int = 64
    kernel: int = 5

    @classmethod
    def from_params(cls, params: PolicyParams) -> "SnapKV":
        return cls(params.snap_window, params.snap_kernel)

    @property
    def queries(self) -> int:
        return self.window

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        att = self._need(obs.recent_attention, "recent_attention")  # (B, H, W, T)
        B, H, W, T = att.shape
        Hkv = obs.positions.shape[1]
        scores = att.float().mean(dim=2)  # (B, H, T)
        scores = F.avg_pool1d(scores, kernel_size=self.kernel, padding=self.kernel // 2, stride=1)  # (B, H, T)
        scores = scores.view(B, Hkv, H // Hkv, T).mean(dim=2)  # (B, Hkv, T)
        return boost_newest(scores, obs.positions, W)
