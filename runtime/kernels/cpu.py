"""The CPU kernels a linear layer may run on: one table, :data:`KERNELS`, each computing
``x @ W.T + b`` in float32 from the same weights (they differ in speed only; which one runs
is measured, :mod:`runtime.kernels.choice`), and the scratch buffer that widens 16-bit and
int8 weights to float32 a block of rows at a time.

Must not import Qt. Nothing runs at import time.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.kernels import onednn

#: Weights are widened into a per-thread float32 scratch buffer of this many elements
#: (16 MiB) instead of a fresh allocation: a fresh one faults its pages in every time,
#: about three times the cost of the copy itself (measured on the AMD machine). A bigger
#: matrix goes through it in blocks of rows (:func:`widened_product`).
SCRATCH_ELEMENTS = 1 << 22


_scratch = threading.local()


def widened(weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` (float16, bfloat16 or int8 codes with per-row ``scale (out,)``) as float32,
    in this thread's scratch buffer (valid until the next call on this thread).

    Raises:
        ValueError: ``weight`` has more than :data:`SCRATCH_ELEMENTS` elements (use
            :func:`widened_product`).
    """
    n = weight.numel()
    if n > SCRATCH_ELEMENTS:
        raise ValueError(f"a {tuple(weight.shape)} matrix does not fit the {SCRATCH_ELEMENTS}-element scratch buffer")
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: usable inside and outside inference mode
            buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    out = buf[:n].view(weight.shape)
    if scale is None:
        return out.copy_(weight)
    return torch.mul(weight, scale.unsqueeze(1), out=out)  # int8 x float32: one pass


def widened_product(
    product: Callable, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``product(x, w, b)`` (a float32 linear: ``x (..., in)``, ``w (out, in)``) with ``w`` the
    16-bit or int8 ``weight`` widened to float32 by :func:`widened`.

    A matrix bigger than the scratch buffer is widened a block of rows at a time, each
    block's product written into its columns of the result: never a float32 copy of the
    whole matrix (the default model's 49152 x 576 LM head would take 113 MB, allocated and
    faulted in on every call). oneDNN's results are bitwise those of one product; MKL's
    matrix-vector path may differ in the last bit.
    """
    rows, cols = weight.shape
    if weight.numel() <= SCRATCH_ELEMENTS:
        return product(x, widened(weight, scale), bias)
    step = SCRATCH_ELEMENTS // cols
    out = x.new_empty((*x.shape[:-1], rows))
    for r0 in range(0, rows, step):
        r = slice(r0, min(r0 + step, rows))
        out[..., r] = product(x, widened(weight[r], None if scale is None else scale[r]), None if bias is None else bias[r])
    return out


def _onednn(x, w, b):
    op = onednn.linear_op()
    if op is None or x.dtype != w.dtype or not (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and onednn.takes_bfloat16())):
        return F.linear(x, w.to(x.dtype), b)
    return op(x, w, b, "none", [None], "")


def _add_bias(y, b):
    return y if b is None else y + b


class WeightRef:
    """What a kernel needs of one matrix: ``weight (out, in)``, optional int8 ``scale (out,)``,
    and a place for a kernel's prepared form of it (fbgemm's packed int8 matrix)."""

    __slots__ = ("weight", "scale", "prepared")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        self.weight, self.scale, self.prepared = weight, scale, {}


def _packed_int8(ref: WeightRef):
    """fbgemm's (x86's) packed int8 matrix of ``ref``, made once from its codes and scales."""
    p = ref.prepared.get("int8-dynamic")
    if p is None:
        import warnings

        w, s = ref.weight, ref.scale
        with warnings.catch_warnings():  # quantized tensors are deprecated; the packed op is what we use
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(w, s.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
        p = ref.prepared["int8-dynamic"] = torch.ops.quantized.linear_prepack(qw, None)
    return p


def _int8_dynamic(x, ref, b):
    # Activations quantized per call (one row in decode: per token) to uint8 with the range
    # reduced to 7 bits, which AVX2's 8-bit multiply-add needs to not saturate.
    shape = x.shape
    y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).contiguous(), _packed_int8(ref), True)
    return _add_bias(y.view(*shape[:-1], -1), b)


def _fbgemm_f16(x, ref, b):
    # FBGEMM's float16-weight product (float32 activations and accumulation; the weights
    # packed once, in blocks of 512 along ``in``). Every output is one running sum over
    # ``in`` in order, whatever the row count or thread count: row-invariant, one row
    # included (runtime.kernels.invariant).
    shape = x.shape
    packed = ref.prepared.get("fbgemm-f16")
    if packed is None:
        packed = ref.prepared["fbgemm-f16"] = _pack_fbgemm_f16(ref.weight)
    zero = ref.prepared.get("zero-bias")
    if b is None and zero is None:
        zero = ref.prepared["zero-bias"] = torch.zeros(ref.weight.shape[0])
    y = torch.fbgemm_linear_fp16_weight(x.reshape(-1, shape[-1]).contiguous(), packed, zero if b is None else b)
    return y.view(*shape[:-1], -1)


def _pack_fbgemm_f16(weight: torch.Tensor):
    """FBGEMM's packed float16 form of a float16 ``weight (out, in)``, made a block of rows at a
    time from float32 (its packing takes float32; float16 -> float32 -> float16 is exact).
    Takes ``ceil(in / 512) * 512 / in`` times the float16 bytes (1.78x for in = 576)."""
    if weight.dtype != torch.float16:
        raise ValueError(f"fbgemm-f16 takes float16 weights, not {weight.dtype}")
    fbgemm_f16_available()  # its deprecation warnings, said once per process, silenced there
    with torch.inference_mode(False):
        return torch.fbgemm_pack_gemm_matrix_fp16(weight.float())


_fbgemm_probe: list[bool] = []


def fbgemm_f16_available() -> bool:
    """Whether this torch has FBGEMM's float16 product (x86 builds with FBGEMM); probed once.

    torch marks the two ops deprecated (they still work in the pinned torch 2.13; the
    tests check them) and warns once per process on the first call of each: the probe
    makes those first calls with the warnings silenced, so a user never sees them.
    """
    if not _fbgemm_probe:
        import warnings

        ok = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(2, 4))
                out = torch.fbgemm_linear_fp16_weight(torch.ones(1, 4), packed, torch.zeros(2))
            ok = torch.equal(out, torch.full((1, 2), 4.0))
        except (RuntimeError, AttributeError, NotImplementedError):
            pass
        _fbgemm_probe.append(ok)
    return _fbgemm_probe[0]


def _int8pack(x, ref, b):
    shape = x.shape
    y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), ref.weight, ref.scale)
    return _add_bias(y.view(*shape[:-1], -1), b)


#: name -> fn(x float32 (..., in), WeightRef, bias float32) -> float32 (..., out). Which
#: weight dtypes each takes is :data:`CANDIDATES`. The decoder runs them only on float32
#: activations (every weight dtype computes in float32 on the CPU by default,
#: :func:`runtime.device.compute_dtype`); other compute dtypes take :func:`runtime.model.layers.linear`.
KERNELS: dict[str, Callable] = {
    "onednn": lambda x, r, b: _onednn(x, r.weight, b),
    "mkl": lambda x, r, b: F.linear(x, r.weight.to(x.dtype), b),
    "f16-gemv": lambda x, r, b: _add_bias(F.linear(x.to(torch.float16), r.weight).to(torch.float32), b),
    "bf16-gemv": lambda x, r, b: _add_bias(F.linear(x.to(torch.bfloat16), r.weight).to(torch.float32), b),
    "widen-onednn": lambda x, r, b: widened_product(_onednn, x, r.weight, r.scale, b),
    "widen-mkl": lambda x, r, b: widened_product(F.linear, x, r.weight, r.scale, b),
    "int8-dynamic": _int8_dynamic,
    "int8pack": _int8pack,
    "fbgemm-f16": _fbgemm_f16,
}
