"""The KV cache's dtype a load gives a model when none is asked for, and what the memory
figures plan with (the same rule, so a fit quotes the cache the load makes). Must not import Qt."""
from __future__ import annotations

import torch

from runtime.device import default_cache_dtype, on_cpu
from runtime.kernels.cache_dtype import blocks_cache_dtype

__all__ = ["cache_dtype_for"]


def cache_dtype_for(device: torch.device | str, weight_dtype: torch.dtype | str, *, blocks: bool = False,
                    head_dim: int | None = None) -> torch.dtype:
    """The KV cache's dtype when none is asked for. For a GGUF run from its own blocks on the
    CPU: the one timed on this machine for heads ``head_dim`` wide
    (:func:`runtime.kernels.cache_dtype.blocks_cache_dtype`: float16 unless ggml's flash
    attention reads bfloat16 faster here, or float32 1.5x faster; float16 when ``head_dim``
    is None or nothing was measured). Otherwise :func:`runtime.device.default_cache_dtype` (the compute dtype).

    Raises:
        ValueError: an unknown dtype name.
    """
    if blocks and on_cpu(device):
        return blocks_cache_dtype(head_dim)
    return default_cache_dtype(device, weight_dtype, blocks=blocks)
