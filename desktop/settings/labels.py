"""What the settings dialog's choices say (:mod:`desktop.settings.dialog`): the weight dtypes,
overflow policies and cache policies, each with the figures runtime measured for it
(``runtime.WEIGHT_DTYPE_QUALITY``, ``runtime.CACHE_POLICY_FIGURES``). Plain strings: must not
import torch or Qt.
"""
from __future__ import annotations

import runtime

__all__ = ["CACHE_POLICY_TEXT", "POLICY_TEXT", "cache_policy_hint", "cache_policy_label", "weight_dtype_label"]


def weight_dtype_label(name: str) -> str:
    """``"float16 — 100.0 % same tokens, Paris ✓"`` from runtime's measured figures."""
    q = runtime.WEIGHT_DTYPE_QUALITY.get(name)
    if q is None:
        return name
    mark = "\u2713" if q["paris"] else "\u2717"
    return f"{name} \u2014 {q['agreement'] * 100:.1f}\u00a0% same tokens, Paris {mark}"


POLICY_TEXT = {
    "stop": "stop: end the reply when the context is full",
    "truncate-middle": "truncate-middle: drop the oldest turns, keep the system prompt",
    "rolling": "rolling: keep the system prompt and a window of the newest",
}

CACHE_POLICY_TEXT = {
    "none": "none: keep every token",   # the overflow policy says what happens when the context is full
    "sinks-window": "sinks + window (StreamingLLM)",
    "h2o": "H2O: the most attended tokens + the newest",
    "snapkv": "SnapKV: what the newest 64 queries look at",
    "tova": "TOVA: what the newest token looks at",
    "key-norm": "key norm: the keys with the smallest norm",
}


def cache_policy_label(policy: str, measured: dict | None = None) -> str:
    """``"H2O: ... — 50 %: 2/10 needles, NLL +0.31 · 25 %: ..."``: the policy and what
    ``attnchat cache-eval`` measured for it on the default model (``runtime.CACHE_POLICY_FIGURES``)."""
    measured = runtime.CACHE_POLICY_FIGURES if measured is None else measured
    text = CACHE_POLICY_TEXT.get(policy, policy)
    if policy == "none" and measured.get("full"):
        found, trials = measured["full"]
        return f"{text} \u2014 {found}/{trials} needles"
    figures = (measured.get("policies") or {}).get(policy)
    if not figures:
        return text
    parts = [f"{share:.0%}: {found}/{trials} needles, NLL {delta:+.2f}"
             for share, (found, trials, delta) in sorted(figures.items(), reverse=True)]
    return f"{text} \u2014 " + " \u00b7 ".join(parts)


def cache_policy_hint(policy: str, measured: dict | None = None) -> str:
    """The hint under the cache policy: the chosen one's measured figures in words, and what a
    policy does."""
    measured = runtime.CACHE_POLICY_FIGURES if measured is None else measured
    what = ("With a policy the cache keeps its budget and evicts the rest; the conversation goes on to the "
            "context length, and the model no longer sees what was evicted.")
    if not measured:
        return what
    # Whose machine: "on a 2-vCPU Intel Xeon" alone read as if it were this computer.
    where = (f"{measured['model']}, measured when attnchat was built on {measured['machine']} (`attnchat "
             "cache-eval` measures this computer; docs/cache-policies.md): needles found in a long "
             "conversation, and the change in the NLL of a held-out text, at each budget (share of the tokens "
             "read).")
    label = cache_policy_label(policy, measured)
    figures = label.split(" \u2014 ", 1)[1] if " \u2014 " in label else ""
    return (f"Measured: {figures}. " if figures else "") + where + " " + what
