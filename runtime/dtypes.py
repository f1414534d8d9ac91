"""Names of the dtypes the runtime takes from a user (weights, KV cache): ``"float16"`` <-> ``torch.float16``.

Its own module because the KV cache, the device defaults and the memory planner all
parse these names, and none of them should have to import another for it. Must not
import Qt or any other runtime module.
"""
from __future__ import annotations

import torch

#: Cache (and weights) dtypes by user-facing name.
CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_cache_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a torch dtype) -> torch dtype.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, torch.dtype):
        if name in CACHE_DTYPES.values():
            return name
        raise ValueError(f"cache dtype {name} is not supported; use one of {', '.join(CACHE_DTYPES)}")
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(str(name).lower(), str(name).lower())
    if key not in CACHE_DTYPES:
        raise ValueError(f"unknown cache dtype {name!r}; use one of {', '.join(CACHE_DTYPES)}")
    return CACHE_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> ``"float32"`` etc."""
    return str(dtype).removeprefix("torch.")
