"""The settings' checks: which values the app can use (:func:`validate`) and the reset of
stored values it cannot (:func:`repair`). The dialog and the controller both use them; the
worker builds the runtime's ``GenerationSettings`` from the same values (a last check here).
Must not import torch.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any, Mapping

import runtime
from desktop.settings.values import DEFAULTS, Settings
from desktop.worker import generation_settings

__all__ = ["validate", "repair", "has_shape", "effective_context", "policy_budget", "CONTEXT_KEYS", "MIN_CONTEXT", "WEIGHT_DTYPES",
           "KEYS", "MODEL_OPTIONS", "MIB"]

log = logging.getLogger(__name__)

MIB = 2**20
#: A chat template and one short message take ~20-40 tokens: below this a context is useless.
MIN_CONTEXT = 64
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")

#: The keys the dialog edits (the rest of DEFAULTS is window state).
KEYS = (
    "generation/context", "generation/cache_limit_mib", "generation/cache_dtype", "generation/overflow",
    "generation/sink_tokens", "generation/system_prompt", "generation/temperature", "generation/top_k",
    "generation/top_p", "generation/min_p", "generation/repetition_penalty", "generation/max_new_tokens",
    "generation/seed", "generation/cache_policy", "generation/cache_budget", "generation/cache_budget_unit",
    "generation/model_sampling", "model/device", "model/weight_dtype", "model/attention_backend", "model/reproducible",
)
MODEL_OPTIONS = ("model/device", "model/weight_dtype", "model/reproducible")
#: The numbers the dialog's editors take (a stored value outside would be silently clamped there).
RANGES = {
    "generation/context": (0, 100_000_000), "generation/cache_limit_mib": (0, 10_000_000),
    "generation/sink_tokens": (0, 1_000_000), "generation/temperature": (0, 100), "generation/top_k": (0, 1_000_000),
    "generation/top_p": (0, 1), "generation/min_p": (0, 1), "generation/repetition_penalty": (0, 10),
    "generation/max_new_tokens": (1, 1_000_000), "generation/seed": (-1, 2**31 - 1),
    "generation/cache_budget": (0, 100_000_000),
}
#: A device name a settings file may hold. Whether this machine has it is checked when the
#: model loads: the worker then falls back to auto and says so (desktop.worker).
DEVICE_NAME = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def has_shape(model: dict | None) -> bool:
    """A local model whose cache we can plan (a remote engine's info has no layers or heads)."""
    return bool(model) and all(model.get(k) for k in ("n_layers", "n_kv_heads", "head_dim"))


def _cache_dtype(values: dict[str, Any], model: dict | None) -> str | None:
    dtype = values["generation/cache_dtype"]
    if dtype == "auto":
        dtype = values["model/weight_dtype"]
        if dtype == "auto":
            dtype = model.get("dtype") if model else None
            if dtype not in runtime.CACHE_DTYPES and model:  # a GGUF's blocks ("Q4_K_M"): the model's default cache dtype
                dtype = model.get("cache_dtype") or model.get("compute_dtype")
        if dtype == "int8":  # int8 weights compute, and so cache, in float32
            dtype = "float32"
    return dtype if dtype in runtime.CACHE_DTYPES else None


#: The settings :func:`effective_context` reads.
CONTEXT_KEYS = ("generation/context", "generation/cache_limit_mib", "generation/cache_dtype",
                "generation/cache_policy", "generation/cache_budget", "generation/cache_budget_unit")


def policy_budget(values: Mapping[str, Any]) -> dict:
    """The cache policy of these settings and its budget as the planner takes them:
    ``{"policy": name, "policy_tokens": tokens or None, "policy_bytes": bytes or None}``
    (``policy`` ``"none"``: no budget)."""
    policy = str(values.get("generation/cache_policy") or "none")
    budget = float(values.get("generation/cache_budget") or 0.0)
    if policy == "none" or budget <= 0:
        return {"policy": "none", "policy_tokens": None, "policy_bytes": None}
    in_mib = str(values.get("generation/cache_budget_unit") or "tokens") == "MiB"
    return {"policy": policy, "policy_tokens": None if in_mib else int(budget),
            "policy_bytes": int(budget * MIB) if in_mib else None}


def effective_context(values: Mapping[str, Any], model: dict | None) -> int:
    """The context limit (tokens) a new session of ``model`` gets from these settings; 0: unknown.

    As :class:`runtime.ChatSession` computes it: the context setting (0: the model's
    maximum) capped at the model's maximum, then at the longest context the KV-cache
    memory limit holds (:func:`runtime.plan`'s ``max_context_in_budget``, sliding-window
    layers included) in the cache dtype (``auto``: the loaded model's compute dtype) -- unless
    a cache policy's budget is below that: then the cache holds only the budget and the
    conversation runs to the first figure.
    The status bar and the KV-cache panel both show this one figure before a reply.
    ``values``: settings keys (:data:`CONTEXT_KEYS`) -> values; ``model``: the info dict.
    """
    max_ctx = int((model or {}).get("context_limit") or 0)
    ctx = int(values.get("generation/context") or 0)
    limit = min(ctx, max_ctx) if ctx and max_ctx else ctx or max_ctx
    mib = float(values.get("generation/cache_limit_mib") or 0.0)
    if not (limit and mib > 0 and has_shape(model)):
        return limit
    dtype = values.get("generation/cache_dtype") or "auto"
    if dtype == "auto":
        dtype = model.get("cache_dtype") or model.get("compute_dtype") or model.get("dtype")
    if dtype not in runtime.CACHE_DTYPES:
        return limit
    windows = list(model.get("layer_windows") or []) or None
    shape = dict(layers=int(model["n_layers"]), kv_heads=int(model["n_kv_heads"]), head_dim=int(model["head_dim"]),
                 cache_dtype=dtype, context=limit, windows=windows)
    try:
        p = runtime.plan(budget_bytes=int(mib * MIB), **shape)
        capped = min(limit, p.max_context_in_budget)
        kept = policy_budget(values)
        if kept["policy"] != "none":   # the session's rule (runtime.generate.session_cache): a budget it can pass
            q = runtime.plan(cache_budget=kept["policy_tokens"], cache_budget_bytes=kept["policy_bytes"], **shape)
            if q.cache_budget is not None and q.cache_budget < capped:
                return limit
    except ValueError:   # a window list that does not match the layers, a budget below a token: no cap we can tell
        return limit
    return capped


def validate(values: dict[str, Any], model: dict | None, devices: list[str]) -> dict[str, str]:
    """The reasons ``values`` (settings keys -> values) cannot be used, by key (empty: all good).

    ``model`` is the loaded model's info dict (context and cache checks against its shape
    need it); ``devices`` the device names this machine has.
    """
    err: dict[str, str] = {}
    ctx = int(values["generation/context"])
    max_ctx = int(model["context_limit"]) if model else None
    if ctx and ctx < MIN_CONTEXT:
        err["generation/context"] = f"at least {MIN_CONTEXT} tokens (a chat template and a short message need that much)"
    elif ctx and max_ctx and ctx > max_ctx:
        err["generation/context"] = f"this model holds at most {max_ctx:,} tokens; use {max_ctx:,} or less"
    limit_mib = float(values["generation/cache_limit_mib"])
    cache_dtype = _cache_dtype(values, model)
    if limit_mib > 0 and has_shape(model) and cache_dtype:
        per_token = runtime.cache_bytes_per_token(int(model["n_layers"]), int(model["n_kv_heads"]),
                                                  int(model["head_dim"]), cache_dtype)
        fits = int(limit_mib * MIB) // per_token
        if fits < MIN_CONTEXT:
            err["generation/cache_limit_mib"] = (
                f"holds only {fits} tokens at {per_token:,} bytes per token; "
                f"give at least {per_token * MIN_CONTEXT / MIB:.2f} MiB (or 0 for no limit)")
    if values["generation/cache_dtype"] not in ("auto", *runtime.CACHE_DTYPES):
        err["generation/cache_dtype"] = f"use auto or one of {', '.join(runtime.CACHE_DTYPES)}"
    if values["generation/overflow"] not in runtime.OVERFLOW_POLICIES:
        err["generation/overflow"] = f"use one of {', '.join(runtime.OVERFLOW_POLICIES)}"
    window = min(ctx, max_ctx) if ctx and max_ctx else ctx or max_ctx
    if values["generation/overflow"] == "rolling" and window and int(values["generation/sink_tokens"]) >= window:
        err["generation/sink_tokens"] = f"the sinks must leave room for a window: at most {window - 1:,} with a {window:,}-token context"
    policy = values["generation/cache_policy"]
    if policy not in runtime.CACHE_POLICIES:
        err["generation/cache_policy"] = f"use one of {', '.join(runtime.CACHE_POLICIES)}"
    elif policy != "none" and values["generation/overflow"] == "rolling":
        err["generation/cache_policy"] = ("rolling already evicts (sinks and a window): choose another "
                                          "'When the context is full', or no cache policy")
    if values["generation/cache_budget_unit"] not in ("tokens", "MiB"):
        err["generation/cache_budget_unit"] = "use tokens or MiB"
    elif policy != "none" and policy in runtime.CACHE_POLICIES:
        budget = float(values["generation/cache_budget"])
        if values["generation/cache_budget_unit"] == "tokens" and budget < MIN_CONTEXT:
            err["generation/cache_budget"] = f"keep at least {MIN_CONTEXT} tokens"
        elif values["generation/cache_budget_unit"] == "MiB" and has_shape(model) and cache_dtype:
            per_token = runtime.cache_bytes_per_token(int(model["n_layers"]), int(model["n_kv_heads"]),
                                                      int(model["head_dim"]), cache_dtype)
            if int(budget * MIB) // per_token < MIN_CONTEXT:
                err["generation/cache_budget"] = (f"holds only {int(budget * MIB) // per_token} tokens; give at "
                                                  f"least {per_token * MIN_CONTEXT / MIB:.2f} MiB")
    if not float(values["generation/top_p"]) > 0:
        err["generation/top_p"] = "must be above 0 (1 turns it off)"
    if not float(values["generation/min_p"]) < 1:
        err["generation/min_p"] = "must be below 1 (0 turns it off)"
    if not float(values["generation/repetition_penalty"]) > 0:
        err["generation/repetition_penalty"] = "must be above 0 (1 turns it off)"
    if values["model/device"] not in devices:
        err["model/device"] = f"{values['model/device']} is not available on this machine; choose one of {', '.join(devices)}"
    if values["model/weight_dtype"] not in WEIGHT_DTYPES:
        err["model/weight_dtype"] = f"use one of {', '.join(WEIGHT_DTYPES)}"
    if values.get("model/reproducible", "off") not in ("off", "on"):
        err["model/reproducible"] = "use off or on"
    if values["model/attention_backend"] not in runtime.ATTENTION_BACKENDS:
        err["model/attention_backend"] = f"use one of {', '.join(runtime.ATTENTION_BACKENDS)}"
    if not err:  # the worker's own conversion: the runtime's checks, in case ours missed one
        try:
            generation_settings({k.split("/", 1)[1]: v for k, v in values.items() if k.startswith("generation/")}, max_ctx)
        except (ValueError, TypeError) as e:
            err["generation/max_new_tokens"] = str(e)
    return err


def repair(settings: Settings, model: dict | None = None) -> list[str]:
    """Reset every stored setting the app cannot use to its default; returns one phrase per reset.

    A settings file edited by hand, or written for another machine or model (context -5,
    device ``quantum``, a cache limit below one token, a context past the loaded model's
    maximum), must never stop the app: it falls back to the defaults and the caller says
    which ones. Each value is checked on its own (its range, the runtime's own checks),
    then all together with :func:`validate` (``model``: the loaded model's info, or None).
    """
    values = {k: settings.get(k) for k in KEYS}
    bad: dict[str, str] = {}
    gen_defaults = {k.split("/", 1)[1]: DEFAULTS[k] for k in KEYS if k.startswith("generation/")}
    for key, value in values.items():
        if not settings.readable(key):
            bad[key] = "not a number"
        elif isinstance(value, float) and not math.isfinite(value):
            bad[key] = "not a finite number"
            continue
        if key.startswith("generation/"):
            try:  # the runtime's own check of this one value
                generation_settings({**gen_defaults, key.split("/", 1)[1]: value})
            except (ValueError, TypeError) as e:
                bad[key] = str(e).strip().splitlines()[0].rstrip(".")
                continue
        if key in RANGES and not RANGES[key][0] <= value <= RANGES[key][1]:
            bad[key] = f"outside {RANGES[key][0]:,}..{RANGES[key][1]:,}"
        elif key == "model/device" and not DEVICE_NAME.fullmatch(str(value)):
            bad[key] = "use auto, cpu, cuda, cuda:N or mps"
    values.update({k: DEFAULTS[k] for k in bad})
    devices = [values["model/device"]]
    for _ in range(len(KEYS)):  # a reset can change what the others are checked against
        try:
            errors = validate(values, model, devices)
        except (ValueError, TypeError, KeyError, OverflowError):  # a model dict without the figures
            log.warning("could not check the settings against %s", model, exc_info=True)
            errors = validate(values, None, devices)
        if not errors:
            break
        for key, reason in errors.items():
            # A default that is refused: validate's last, runtime-wide check blames a combination.
            culprits = [key] if values[key] != DEFAULTS[key] else [k for k in values if k.startswith("generation/")]
            for k in culprits:
                if values[k] != DEFAULTS[k]:
                    bad.setdefault(k, reason)
                    values[k] = DEFAULTS[k]
    out = []
    for key, reason in bad.items():
        stored = settings.stored(key)
        log.warning("setting %s=%r reset to %r: %s", key, stored, DEFAULTS[key], reason)
        out.append(f"{key.split('/', 1)[1].replace('_', ' ')} {stored} ({reason})")
        settings.reset(key)
    return out
