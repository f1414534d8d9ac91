"""KV-cache eviction policies: which cached tokens a full-attention layer keeps when its budget is spent.

Must not import Qt, the decoder or the session: pure functions of tensors (what a layer
has observed -> the slots it keeps). :mod:`runtime.cache.evictor` gathers the
observations during the forward passes and applies the choice to the cache.

Every policy scores each slot of one layer per KV head (higher = keep) and keeps the
``n_keep`` best (:func:`keep_slots`); heads of one layer may keep different positions
(the cache's buffers are per KV head, and a decoding query never needs a key's position:
its rotation was applied when it was cached). The policies, as NVIDIA's kvpress
(github.com/NVIDIA/kvpress, ``kvpress/presses``) implements them:

- ``sinks-window``: StreamingLLM (Xiao et al. 2023, arXiv:2309.17453): the first
  ``sink_tokens`` positions and the newest ones. Unlike the ``rolling`` overflow policy
  (:mod:`runtime.generate.context`) the kept keys are not re-rotated: later queries use
  their true positions (kvpress's ``StreamingLLMPress`` without ``KeyRerotationPress``).
- ``h2o``: Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048): the attention each
  key has received from every query since it was cached, summed (the "heavy hitters"),
  plus the newest ``h2o_recent`` share of the budget (the paper's recent window; its
  experiments split the budget half and half).
- ``snapkv``: SnapKV (Li et al. 2024, arXiv:2404.14469): the attention of the newest
  ``snap_window`` queries (at the end of a prompt: the question), averaged over those
  queries, smoothed along the slots by an average pool of ``snap_kernel`` and averaged
  over the query heads of each KV head; the window's own tokens are kept.
- ``tova``: TOVA (Oren et al. 2024, arXiv:2401.06104): the newest query's attention,
  averaged over all heads of the layer (so every KV head keeps the same positions).
- ``key-norm``: the keys' L2 norm, lowest kept (Devoto et al. 2024, arXiv:2406.11430:
  low-norm keys draw high attention). Needs no attention at all.

Whatever the policy, the newest token is kept (TOVA as kvpress runs it does the same):
the next query always reads its predecessor. Ties go to the newer position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: ``none`` keeps every token (the cache grows until its limit, then the overflow policy acts).
CACHE_POLICIES = ("none", "sinks-window", "h2o", "snapkv", "tova", "key-norm")


@dataclass(frozen=True)
class PolicyParams:
    """The policies' knobs (defaults: kvpress's and the papers').

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


#: What each policy reads from a :class:`LayerObservation` (besides positions).
NEEDS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "sinks-window": frozenset(),
    "h2o": frozenset({"accumulated"}),
    "snapkv": frozenset({"recent_attention"}),
    "tova": frozenset({"recent_attention"}),
    "key-norm": frozenset({"keys"}),
}


def check_policy(name: str) -> str:
    """``name`` if it is one of :data:`CACHE_POLICIES`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in CACHE_POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; use one of {', '.join(CACHE_POLICIES)}")
    return name


def observed_queries(name: str, params: PolicyParams = PolicyParams()) -> int:
    """How many of the newest queries per layer ``name`` reads (``recent_attention``'s W)."""
    return {"snapkv": params.snap_window, "tova": 1}.get(name, 0)


# ---- scores (higher = keep), each (B, Hkv, T) ----------------------------------------------
def sinks_window_scores(obs: LayerObservation, params: PolicyParams) -> torch.Tensor:
    """1 for the first ``sink_tokens`` positions, else the position (newer = higher): the
    sinks, then the newest tokens."""
    pos = obs.positions.float()
    return torch.where(obs.positions < params.sink_tokens, torch.full_like(pos, float("inf")), pos)


def h2o_scores(obs: LayerObservation, n_keep: int, params: PolicyParams) -> torch.Tensor:
    """The accumulated attention, with the newest ``round(h2o_recent * n_keep)`` slots first."""
    acc = _need(obs.accumulated, "h2o", "accumulated")
    n_recent = int(round(params.h2o_recent * n_keep))
    return _boost_newest(acc.float(), obs.positions, n_recent)


def snapkv_scores(obs: LayerObservation, params: PolicyParams) -> torch.Tensor:
    """The observation window's attention, averaged over its queries, pooled along the slots
    (average pool of ``snap_kernel``, zero padding counted as kvpress does) and averaged
    over each KV head's query heads; the window's own tokens first."""
    att = _need(obs.recent_attention, "snapkv", "recent_attention")  # (B, H, W, T)
    B, H, W, T = att.shape
    Hkv = obs.positions.shape[1]
    scores = att.float().mean(dim=2)  # (B, H, T)
    k = params.snap_kernel
    scores = F.avg_pool1d(scores, kernel_size=k, padding=k // 2, stride=1)  # (B, H, T)
    scores = scores.view(B, Hkv, H // Hkv, T).mean(dim=2)  # (B, Hkv, T)
    return _boost_newest(scores, obs.positions, W)


def tova_scores(obs: LayerObservation) -> torch.Tensor:
    """The newest query's attention averaged over every head of the layer, the same for
    each KV head."""
    att = _need(obs.recent_attention, "tova", "recent_attention")  # (B, H, W, T)
    last = att[:, :, -1].float().mean(dim=1, keepdim=True)  # (B, 1, T)
    return last.expand(-1, obs.positions.shape[1], -1)


def key_norm_scores(obs: LayerObservation) -> torch.Tensor:
    """Minus each key's L2 norm (low-norm keys are kept)."""
    keys = _need(obs.keys, "key-norm", "keys")
    return -keys.float().norm(dim=-1)


def scores(name: str, obs: LayerObservation, n_keep: int, params: PolicyParams = PolicyParams()) -> torch.Tensor:
    """Policy ``name``'s scores ``(B, Hkv, T)`` float32 (higher = keep; ``inf``: always kept)."""
    check_policy(name)
    if name == "none":
        return torch.full(obs.positions.shape, float("inf"), device=obs.positions.device)
    if name == "sinks-window":
        return sinks_window_scores(obs, params)
    if name == "h2o":
        return h2o_scores(obs, n_keep, params)
    if name == "snapkv":
        return snapkv_scores(obs, params)
    if name == "tova":
        return tova_scores(obs)
    return key_norm_scores(obs)


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
    score = _boost_newest(score.float(), positions, 1)
    newest_first = torch.argsort(positions, dim=-1, descending=True, stable=True)  # ties -> newer
    ranked = torch.argsort(score.gather(-1, newest_first), dim=-1, descending=True, stable=True)[..., :n_keep]
    kept = newest_first.gather(-1, ranked)
    return kept.sort(dim=-1).values


def choose(name: str, obs: LayerObservation, n_keep: int, params: PolicyParams = PolicyParams()) -> torch.Tensor:
    """The slots ``(B, Hkv, n_keep)`` policy ``name`` keeps for one layer (:func:`keep_slots`
    of :func:`scores`)."""
    return keep_slots(scores(name, obs, n_keep, params), obs.positions, n_keep)


# ---- helpers ----------------------------------------------------------------------------------
def _need(t: torch.Tensor | None, policy: str, what: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"the {policy} policy needs the layer's {what}")
    return t


def _boost_newest(score: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """``score`` with the ``n`` newest slots of each head set to ``inf`` (always kept)."""
    if n <= 0:
        return score
    n = min(n, positions.shape[-1])
    threshold = positions.topk(n, dim=-1).values[..., -1:]  # (B, Hkv, 1): the n-th newest position
    return torch.where(positions >= threshold, torch.full_like(score, float("inf")), score)
