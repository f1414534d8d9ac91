"""Symmetric 8-bit quantization: one float32 scale per vector, shared by int8 weights and the int8 KV cache.

Must not import Qt. Pure tensor functions, nothing stored here.

``q = round(x / s)`` clamped to ``-127 .. 127`` with ``s = max|x| / 127`` over the last
axis, so ``x ~ q * s`` with an absolute error of at most ``s / 2`` per element (the
"absmax" scheme of Dettmers et al. 2022, "LLM.int8()", section 3.1, per vector instead
of per tensor). -128 is never used, so negation is exact and the range is symmetric.
An all-zero vector gets scale 0 and quantizes to zeros.
"""
from __future__ import annotations

import torch

#: The largest magnitude an int8 code takes (symmetric: -127 .. 127).
QMAX = 127


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (..., N)`` (any float dtype) -> codes ``(..., N)`` int8 and scales ``(..., 1)`` float32.

    Each vector along the last axis gets its own scale ``max|x| / 127``.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / QMAX  # (..., 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero vectors: codes 0
    q = torch.round(x / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes ``(..., N)`` int8 and scales ``(..., 1)`` float32 -> ``q * scale`` ``(..., N)`` in ``dtype``.

    ``out`` (optional, ``dtype``, same shape) receives the result without a new allocation.
    """
    if out is not None and dtype == torch.float32:
        return torch.mul(q, scale, out=out)  # int8 x float32 promotes to float32: one pass
    y = q.float() * scale
    y = y if dtype == torch.float32 else y.to(dtype)
    return y if out is None else out.copy_(y)
