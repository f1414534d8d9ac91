"""Names of the dtypes the runtime takes from a user (weights, KV cache): ``"float16"`` <-> ``torch.float16``.

Its own module because the KV cache, the device defaults and the memory planner all
parse these names, and none of them should have to import another for it. Must not
import Qt or any other runtime module (the byte formula is :mod:`models`', below runtime).
"""
from __future__ import annotations

import torch

from models import kv_bytes

#: Cache (and weights) dtypes by user-facing name.
CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
#: Cache dtypes stored as codes plus one float32 scale per (token, KV head) vector
#: (:mod:`runtime.quantize`).
QUANTIZED_CACHE_DTYPES = (torch.int8,)
#: Bytes of one vector's scale in a quantized cache (float32).
SCALE_BYTES = 4
#: Weight dtypes by user-facing name (``--dtype``, the Weight dtype setting); int8 weights
#: are codes with one float32 scale per output row (:func:`runtime.weights.convert.quantize_state`).
WEIGHT_DTYPES: dict[str, torch.dtype] = dict(CACHE_DTYPES)


def parse_cache_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16" | "int8"`` (or a torch dtype) -> torch dtype.

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


def parse_weight_dtype(name: str | torch.dtype) -> torch.dtype:
    """A weight dtype's name (or torch dtype) -> torch dtype.

    Raises:
        ValueError: a dtype the weights cannot be stored in (the message lists those).
    """
    try:
        dtype = parse_cache_dtype(name)
    except ValueError:
        dtype = None
    if dtype not in WEIGHT_DTYPES.values():
        raise ValueError(f"unknown weight dtype {name!r}; use one of {', '.join(WEIGHT_DTYPES)}")
    return dtype


def cache_number_bytes(dtype: str | torch.dtype) -> tuple[int, int]:
    """``(element bytes, scale bytes per vector)`` of a cache of ``dtype``: the two numbers the
    KV byte formula (:mod:`models.kv_bytes`) takes; the scale is :data:`SCALE_BYTES` for a
    quantized dtype, else 0.

    Raises:
        ValueError: an unknown dtype.
    """
    dt = parse_cache_dtype(dtype)
    return dt.itemsize, (SCALE_BYTES if dt in QUANTIZED_CACHE_DTYPES else 0)


def vector_bytes(dtype: str | torch.dtype, head_dim: int) -> int:
    """Bytes one key (or value) vector of ``head_dim`` numbers takes in a cache of ``dtype``:
    ``head_dim x element bytes``, plus :data:`SCALE_BYTES` for a quantized dtype
    (:func:`models.kv_bytes.vector_bytes`).

    Raises:
        ValueError: an unknown dtype.
    """
    return kv_bytes.vector_bytes(head_dim, *cache_number_bytes(dtype))
