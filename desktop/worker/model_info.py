"""A loaded model described in plain data (for the status bar, the panels and the stats'
``model`` key), so nothing on the GUI side holds the model itself.

Imports runtime's public API and models only (no torch, no Qt).
"""
from __future__ import annotations

from typing import Any

import models.sampling_defaults
import runtime

__all__ = ["model_info", "model_key"]


def model_info(model: "runtime.Model") -> dict[str, Any]:
    """A plain-data description of a loaded model (for the status bar and the panels)."""
    if getattr(model, "remote", False):  # a server's model describes itself (desktop.remote.engine)
        return model.info()
    c = model.config
    dtype = str(model.dtype).removeprefix("torch.")
    return {
        "name": model.name, "path": str(model.path), "device": str(model.device), "dtype": dtype,
        "compute_dtype": str(getattr(model, "compute_dtype", model.dtype)).removeprefix("torch."),
        # the KV cache's dtype when the settings say "auto" (runtime.cache_dtype_for: for a GGUF's blocks on the CPU, timed here)
        "cache_dtype": str(getattr(model, "cache_dtype", None) or getattr(model, "compute_dtype", model.dtype)).removeprefix("torch."),
        "context_limit": c.max_position_embeddings, "n_layers": c.n_layers, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "load_seconds": model.load_seconds,
        "weights_bytes": getattr(model, "weights_bytes", None),
        "reproducible": bool(getattr(model, "reproducible", False)),
        # Which row-invariant kernel the reproducible mode runs on this machine, and why.
        "reproducible_kernel": (getattr(getattr(model, "kernels", None), "reason", "")
                                if getattr(model, "reproducible", False) else ""),
        "chat_template": bool(getattr(model, "has_chat_template", True)),
        # What the template sends as the system prompt when none is set (SmolLM2's names itself).
        "builtin_system_prompt": runtime.builtin_system_prompt(getattr(model, "tokenizer", None)),
        # Per layer its sliding window in tokens, or None (full attention).
        "layer_windows": list(getattr(c, "windows", ())),
        # What its file says to sample with ({"values", "source"}), or None.
        "sampling": _sampling(model),
    }


def _sampling(model) -> dict | None:
    found = models.sampling_defaults.read_sampling_defaults(model.path) if getattr(model, "path", None) else None
    return found.to_dict() if found is not None else None


def model_key(info: dict | None) -> str:
    """Which model a reply came from, as its stats record it (``stats["model"]``): a server's
    source (address and model id), else the model file's or folder's path; "" for none."""
    return str((info or {}).get("source") or (info or {}).get("path") or "")
