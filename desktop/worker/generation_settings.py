"""The desktop's settings (a plain dict, keys as in ``desktop.settings.values``) as the
runtime's :class:`runtime.GenerationSettings`.

Imports runtime's public API only (no torch, no Qt).
"""
from __future__ import annotations

from typing import Any

import runtime

__all__ = ["generation_settings"]


def generation_settings(s: dict[str, Any], max_context: int | None = None) -> "runtime.GenerationSettings":
    """The runtime's settings from the desktop's plain dict (keys as in ``desktop.settings.values``).

    ``seed`` < 0 or None: a fresh seed per reply; ``cache_dtype`` ``"auto"``: the model's
    default (:func:`runtime.default_cache_dtype`); ``cache_limit_mib`` 0: no limit; ``context`` 0: the model's maximum, and a
    context past ``max_context`` (a model loaded after it was set) is capped there. ``cache_policy`` other than
    ``"none"``: ``cache_budget`` in ``cache_budget_unit`` (``"tokens"`` or ``"MiB"``) is what it keeps.

    Raises:
        ValueError: a value out of range.
    """
    seed = s.get("seed")
    sampling = runtime.SamplingParams(
        temperature=float(s.get("temperature", 0.0)), top_k=int(s.get("top_k", 0)), top_p=float(s.get("top_p", 1.0)),
        min_p=float(s.get("min_p", 0.0)), repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        seed=None if seed is None or int(seed) < 0 else int(seed))
    context = int(s["context"]) if s.get("context") else None
    if context and max_context:
        context = min(context, max_context)
    cache_dtype = s.get("cache_dtype") or "auto"
    limit_mib = float(s.get("cache_limit_mib") or 0.0)
    policy = str(s.get("cache_policy") or "none")
    budget = float(s.get("cache_budget") or 0.0)
    in_mib = str(s.get("cache_budget_unit") or "tokens") == "MiB"
    if policy != "none" and not budget > 0:
        raise ValueError(f"the {policy} cache policy needs a budget above 0")
    budgets = {} if policy == "none" else (
        {"cache_budget_bytes": int(budget * 2**20)} if in_mib else {"cache_budget": int(budget)})
    return runtime.GenerationSettings(
        sampling=sampling,
        max_new_tokens=int(s.get("max_new_tokens", 512)),
        context_limit=context,
        overflow=str(s.get("overflow", "truncate-middle")),
        sink_tokens=int(s.get("sink_tokens", 4)),
        cache_dtype=None if cache_dtype == "auto" else str(cache_dtype),
        cache_limit_bytes=int(limit_mib * 2**20) if limit_mib > 0 else None,
        cache_policy=policy, **budgets,
    )
