"""oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``): probed per dtype on first
use, and wrapped as an opaque op for compiled code.

Must not import Qt. Nothing is probed at import time.

Why oneDNN: for one token, the float32 matrix-vector product that ``F.linear`` hands to
MKL read weights at about 10 GB/s on our 2-core benchmark machine, oneDNN's at about
24 GB/s (measured on the 49152 x 576 LM head of the default model), and decode reads
every weight once per token.
"""
from __future__ import annotations

import torch

#: The dtypes whose inner product is probed (oneDNN builds without bfloat16 for some CPUs).
DTYPES = (torch.float32, torch.bfloat16)

#: dtype -> oneDNN's linear op (None where it does not work here); filled on first use.
_OPS: dict[torch.dtype, object] = {}

#: Whether ``torch.ops.attnchat.onednn_linear`` is defined (by :func:`register_compiled_op`).
compiled_op_ready = False


def _probe(dtype: torch.dtype):
    """``torch.ops.mkldnn._linear_pointwise`` when this torch build has it and it computes
    a known product right in ``dtype`` on this CPU, else None.

    Per dtype: oneDNN builds without a bfloat16 inner product for some CPUs ("could not
    create a primitive descriptor", seen on an AMD EPYC Zen 3 with AVX2 and no AVX-512) while
    float32 works.
    """
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        op = torch.ops.mkldnn._linear_pointwise
        with torch.inference_mode():
            out = op(torch.ones(1, 2, dtype=dtype), torch.ones(3, 2, dtype=dtype), None, "none", [None], "")
        return op if torch.equal(out.float(), torch.full((1, 3), 2.0)) else None
    except (AttributeError, RuntimeError):
        return None


def linear_op(dtype: torch.dtype = torch.float32):
    """oneDNN's linear op for ``dtype`` (probed once, on first use), or None where it does
    not run here. Call it as ``op(x, weight, bias, "none", [None], "")``."""
    if dtype not in _OPS:
        _OPS[dtype] = _probe(dtype)
    return _OPS[dtype]


def takes_bfloat16() -> bool:
    """Whether oneDNN's inner product runs bfloat16 on this CPU: it needs AVX512-BF16 or
    AMX; on an AMD Zen 3 (AVX2 only) it refuses to build the primitive."""
    return linear_op(torch.bfloat16) is not None


def register_compiled_op() -> None:
    """Probe oneDNN's linear op now, and when it works define ``attnchat::onednn_linear``
    (float32 ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``) for compiled code.

    Call before ``torch.compile`` traces :func:`runtime.model.layers.linear`, which cannot
    probe while tracing. Inductor lowers oneDNN's own op only for weights frozen into the
    graph (a packed copy of every weight), so the compiled step calls it through this
    opaque op instead.
    """
    global compiled_op_ready
    for dtype in DTYPES:
        linear_op(dtype)
    if compiled_op_ready or _OPS.get(torch.float32) is None:
        return
    op = _OPS[torch.float32]

    @torch.library.custom_op("attnchat::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return op(x, weight, None, "none", [None], "")

    @onednn_linear.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    compiled_op_ready = True
