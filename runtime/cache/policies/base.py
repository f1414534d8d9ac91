"""What every cache policy shares: its knobs, what a layer shows it, and the top-k gather.

Must not import Qt, the decoder or the generator: pure functions of tensors.

A policy (one module each beside this one, as in NVIDIA's kvpress, ``kvpress/presses``) is a
small frozen dataclass with the knobs it needs and :meth:`Policy.score`: per slot of one
full-attention layer, per KV head, how much to keep it (higher = keep). The gather of the
``n_keep`` best lives once, here (:func:`keep_slots`, kvpress's ``ScorerPress.compress``):
heads of one layer may keep different positions (the cache's buffers are per KV head, and a
decoding query never needs a key's position: its rotation was applied when it was cached).
Whatever the policy, the newest token is kept (TOVA as kvpress runs it does the same): the
next query always reads its predecessor. Ties go to the newer position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class PolicyParams:
    """The policies' knobs as the user sets them (defaults: kvpress's and the papers').

    Attributes:
        sink_tokens: first positions ``sinks-window`` always keeps (StreamingLLM: 4).
        snap_window: queries SnapKV observes (kvpress: 64; the paper's 32 is close).
        snap_kernel: width of SnapKV's average pool along the slots (kvpress: 5; odd).
        h2o_recent: share of the budget H2O gives to the newest tokens (the paper: 0.5).
    """

    sink_tokens: int = 4
    snap_window: int = 64
    snap_kernel: int = 5
    h2o_recent: float = 0.5

    def __post_init__(self) -> None:
        if self.sink_tokens < 0 or self.snap_window < 1 or self.snap_kernel < 1 or self.snap_kernel % 2 == 0:
            raise ValueError(f"policy parameters out of range: {self}; sinks >= 0, window >= 1, odd kernel >= 1")
        if not 0.0 <= self.h2o_recent <= 1.0:
            raise ValueError(f"h2o_recent is a share of the budget in 0..1; got {self.h2o_recent}")


@dataclass(frozen=True)
class LayerObservation:
    """What one full-attention layer shows a policy when it must choose (batch ``B``, ``Hkv``
    KV heads, ``T`` cached slots, ``H`` query heads).

    Attributes:
        positions: ``(B, Hkv, T)`` int64, the true position of each slot (ascending along T).
        keys: ``(B, Hkv, T, D)`` the cached keys (after RoPE; norms do not depend on it).
        recent_attention: ``(B, H, W, T)`` float32, the attention weights of the ``W``
            newest queries over the slots (0 where a query could not see a key).
        accumulated: ``(B, Hkv, T)`` float32, the attention each slot has received from
            every query since it was cached, summed over queries, averaged over the query
            heads of its KV head.
    """

    positions: torch.Tensor
    keys: torch.Tensor | None = None
    recent_attention: torch.Tensor | None = None
    accumulated: torch.Tensor | None = None


@dataclass(frozen=True)
class Policy:
    """A cache policy: which slots of a full-attention layer to keep.

    Subclasses set :attr:`name` (the command line's), :attr:`needs` (the
    :class:`LayerObservation` fields besides positions it reads), override :meth:`score`, and
    :meth:`from_params` when they have knobs.
    """

    name: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_params(cls, params: PolicyParams) -> "Policy":
        """The policy with its knobs taken from ``params``."""
        return cls()

    @property
    def queries(self) -> int:
        """How many of the newest queries per layer it reads (``recent_attention``'s W)."""
        return 0

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        """``(B, Hkv, T)`` float32, higher = keep (``inf``: always kept)."""
        raise NotImplementedError

    def choose(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        """The ``(B, Hkv, n_keep)`` slots it keeps for one layer (:func:`keep_slots` of :meth:`score`)."""
        return keep_slots(self.score(obs, n_keep), obs.positions, n_keep)

    def _need(self, t: torch.Tensor | None, what: str) -> torch.Tensor:
        if t is None:
            raise ValueError(f"the {self.name} policy needs the layer's {what}")
        return t


@dataclass(frozen=True)
class KeepAll(Policy):
    """``none``: every slot alike (a forced eviction keeps the newest); no cache policy at work."""

    name: ClassVar[str] = "none"

    def score(self, obs: LayerObservation, n_keep: int) -> torch.Tensor:
        return torch.full(obs.positions.shape, float("inf"), device=obs.positions.device)


def keep_slots(score: torch.Tensor, positions: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The ``n_keep`` slots with the highest ``score`` per KV head, in position order.

    The newest slot is always kept; among equal scores the newer position wins.

    Args:
        score: ``(B, Hkv, T)`` float.
        positions: ``(B, Hkv, T)`` int64, the slots' true positions (ascending).
        n_keep: slots to keep, ``1 <= n_keep <= T``.

    Returns:
        ``(B, Hkv, n_keep)`` int64 slot indices, ascending (so the kept keys stay in
        position order).

    Raises:
        ValueError: ``n_keep`` outside ``1 .. T``.
    """
    T = score.shape[-1]
    if not 1 <= n_keep <= T:
        raise ValueError(f"cannot keep {n_keep} of {T} slots")
    score = boost_newest(score.float(), positions, 1)
    newest_first = torch.argsort(positions, dim=-1, descending=True, stable=True)  # ties -> newer
    ranked = torch.argsort(score.gather(-1, newest_first), dim=-1, descending=True, stable=True)[..., :n_keep]
    kept = newest_first.gather(-1, ranked)
    return kept.sort(dim=-1).values


def boost_newest(score: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """``score`` with the ``n`` newest slots of each head set to ``inf`` (always kept)."""
    if n <= 0:
        return score
    n = min(n, positions.shape[-1])
    threshold = positions.topk(n, dim=-1).values[..., -1:]  # (B, Hkv, 1): the n-th newest position
    return torch.where(positions >= threshold, torch.full_like(score, float("inf")), score)
