"""KV-cache policies: which cached tokens a full-attention layer keeps when its budget is spent.

May import torch and the cache's own modules; never the decoder, the generator or Qt (an
import-linter contract). One module per policy, each a small class with its knobs and a
``score()`` (:mod:`.base` says what they share), as NVIDIA's kvpress (``kvpress/presses``)
implements them:

- ``sinks-window`` (:mod:`.sinks_window`): StreamingLLM, the first tokens and the newest; the
  same module gives the ``rolling`` overflow policy its cut.
- ``h2o`` (:mod:`.h2o`): the keys that drew the most attention, and the newest.
- ``snapkv`` (:mod:`.snapkv`): what the newest queries look at, pooled.
- ``tova`` (:mod:`.tova`): what the newest query looks at.
- ``key-norm`` (:mod:`.key_norm`): the lowest-norm keys.

:mod:`.evictor` observes the forward passes and applies a policy to a cache; :mod:`.figures`
holds what each one kept of the default model's abilities. A new policy is a module here and
a line in :data:`POLICIES`.
"""
from __future__ import annotations

import torch

from runtime.cache.policies.base import KeepAll, LayerObservation, Policy, PolicyParams, keep_slots
from runtime.cache.policies.h2o import H2O
from runtime.cache.policies.key_norm import KeyNorm
from runtime.cache.policies.sinks_window import SinksWindow
from runtime.cache.policies.snapkv import SnapKV
from runtime.cache.policies.tova import TOVA

__all__ = ["CACHE_POLICIES", "POLICIES", "LayerObservation", "Policy", "PolicyParams", "check_policy", "choose",
           "keep_slots", "make_policy"]

#: Every policy by its name, in the order the settings list them. ``none`` keeps every token
#: (the cache grows until its limit, then the overflow policy acts).
POLICIES: dict[str, type[Policy]] = {p.name: p for p in (KeepAll, SinksWindow, H2O, SnapKV, TOVA, KeyNorm)}
CACHE_POLICIES = tuple(POLICIES)


def check_policy(name: str) -> str:
    """``name`` if it is one of :data:`CACHE_POLICIES`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; use one of {', '.join(CACHE_POLICIES)}")
    return name


def make_policy(name: str, params: PolicyParams = PolicyParams()) -> Policy:
    """Policy ``name`` with its knobs from ``params``.

    Raises:
        ValueError: an unknown name.
    """
    return POLICIES[check_policy(name)].from_params(params)


def choose(name: str, obs: LayerObservation, n_keep: int, params: PolicyParams = PolicyParams()) -> torch.Tensor:
    """The slots ``(B, Hkv, n_keep)`` policy ``name`` keeps for one layer (:meth:`Policy.choose`)."""
    return make_policy(name, params).choose(obs, n_keep)
