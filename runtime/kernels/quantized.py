"""Linear products on a GGUF's quantized weights, per device and block type, chosen by timing.
Must not import Qt or transformers.

A ``QuantWeight`` (:mod:`runtime.weights.quant_weight`) is one matrix in its file's own
blocks (a memory-mapped ``uint8 (rows, row bytes)``) and its block type; each kernel of :data:`QUANT_KERNELS` prepares what it takes from those blocks once
(nothing, a repack, or a widened copy) and computes ``x @ W.T`` in float32:

- ``ggml``: ggml's own ``mul_mat`` on the raw blocks (:mod:`runtime.kernels.ggml_ops`),
  activations quantized per block of 32 as llama.cpp does. CPU, every type of the table
  (Q2_K, Q3_K, the IQ codebooks, TQ, MXFP4 and NVFP4 run only here or widened); needs ggml-python.
- ``int4pack-bf16`` / ``int4pack-f16``: torch's ``_weight_int4pack_mm_for_cpu`` on 4-bit
  types (Q4_0, Q4_1, Q4_K) repacked with scales and zeros per group of 32, activations
  rounded to bfloat16 / float16. CPU.
- ``int4pack-cuda``: tinygemm's ``_weight_int4pack_mm`` (bfloat16). CUDA only; its repack's
  layout is checked on the CPU (``runtime.weights.quant_types.tinygemm_operands``).
- ``int8pack``: torch's ``_weight_int8pack_mm``, the weights requantized to int8 per row
  (not the file's groups: adds rounding). Any device where the op exists.
- ``f16``: the weights widened to float16 once (twice to four times the file's bytes),
  torch's float16 GEMV for one row, float32 products (oneDNN) on a widened block of rows
  for several. Any type; the ``--dtype float16`` comparison path.
- ``widen``: the blocks dequantized per call into a float32 scratch buffer (ggml's
  ``to_float`` where it loads, a block of rows at a time), then oneDNN's float32 product:
  no memory beyond the file's blocks; compute-bound prefill amortizes the widening over
  the chunk's rows (without ggml, torch's decoding is ~100x slower: a last resort).
- ``widen-bf16``: ``widen``'s blocks rounded to bfloat16 and oneDNN's bfloat16 product on
  activations rounded to bfloat16. CPU, where oneDNN multiplies bfloat16 (AVX512-BF16, AMX).

Which kernel runs is measured per machine and block type
(:mod:`runtime.kernels.quant_choice`), as the float kernels are (:mod:`runtime.kernels.choice`):
one for a single row (decode) and one for several (prefill).
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from runtime.device import on_cpu

log = logging.getLogger(__name__)

# The weights a kernel takes are :class:`runtime.weights.quant_weight.QuantWeight` objects,
# read by their attributes (``raw``, ``btype`` with ``name/ggml_type/bits/group/quantized/
# block_size/block_bytes``, ``rows``, ``cols``, ``prepared``) and their methods
# (``form(name, device)``: a repack; ``dequantized(...)``: torch's decoding): kernels do
# not import the weights package (the layers contract keeps the two independent).
QuantWeight = Any  # runtime.weights.quant_weight.QuantWeight
BlockType = Any  # runtime.weights.quant_types.BlockType


def widen(w: QuantWeight, dtype: torch.dtype = torch.float32, rows: slice | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """``w``'s weights ``(rows, cols)`` (or a slice of rows) in ``dtype`` (float32 into ``out``
    when given): ggml's ``to_float`` where it loads (C; ~100x torch's decoding on the Intel
    Xeon), else ``w.dequantized``. Both are bitwise ``gguf.quants.dequantize``."""
    from runtime.kernels import ggml_ops

    raw = _blocks_of(w, rows)
    if not (w.btype.quantized and _cpu_branch(raw) and ggml_ops.available()):
        return w.dequantized(dtype, rows, out)
    buf = out if out is not None else torch.empty(raw.shape[0], w.cols, dtype=torch.float32)
    ggml_ops.to_float(raw if raw.is_contiguous() else raw.contiguous(), w.btype.ggml_type, buf)
    return buf if dtype == torch.float32 else buf.to(dtype)


def _blocks_of(w: QuantWeight, rows: slice | None) -> torch.Tensor:
    """``w``'s blocks of ``rows``: a view of them in memory, or (dropped for a repacked form)
    read from the file into this thread's ``uint8`` scratch buffer, so that a prefill call
    allocates nothing."""
    if w.resident:
        return w.blocks(rows)
    start, stop, _ = (rows or slice(None)).indices(w.rows)
    row_bytes = w.btype.row_bytes(w.cols)
    return w.blocks(rows, out=_scratch_rows(stop - start, row_bytes, torch.uint8))


def lookup(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 rows ``ids`` (any shape of int64 ids) of ``w`` -> ``(*ids.shape, cols)``: an
    embedding lookup that widens only the rows asked for."""
    flat = ids.reshape(-1)
    rows = w.take(flat)
    from runtime.kernels import ggml_ops

    if w.btype.quantized and _cpu_branch(rows) and ggml_ops.available():
        out = torch.empty(flat.numel(), w.cols, dtype=torch.float32)
        ggml_ops.to_float(rows, w.btype.ggml_type, out)
    else:
        out = w.decode(rows)
    return out.view(*ids.shape, w.cols)


@dataclass(frozen=True)
class QuantKernel:
    """A way to compute ``x (M, in) float32 @ W.T -> (M, out) float32`` from a :class:`QuantWeight`.

    Attributes:
        name: key in :data:`QUANT_KERNELS`.
        devices: device types it runs on.
        takes: which block types it takes.
        prepare: weight, device -> the kernel's form of it (kept in ``weight.prepared``).
        run: x, prepared form, weight -> float32 result.
        available: whether it can run in this process (probed on first use).
    """

    name: str
    devices: tuple[str, ...]
    takes: Callable[[BlockType], bool]
    prepare: Callable[[QuantWeight, torch.device], object]
    run: Callable[[torch.Tensor, object, QuantWeight], torch.Tensor]
    available: Callable[[], bool] = field(default=lambda: True)


# ---- the kernels ----------------------------------------------------------------------------
def _rows2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _ggml_prepare(w: QuantWeight, device: torch.device):
    from runtime.kernels.ggml_ops import REPACKED, GGMLMatrix

    form = w.prepared.get(REPACKED)   # the repacked form, once made, instead of the blocks
    if form is not None:
        return GGMLMatrix(None, w.btype.ggml_type, w.rows, w.cols, form=form)
    return GGMLMatrix(w.raw, w.btype.ggml_type, w.rows, w.cols)


def _ggml_run(x: torch.Tensor, m, w: QuantWeight) -> torch.Tensor:
    return m(x if x.dtype == torch.float32 else x.float())


def _ggml_exact_run(x: torch.Tensor, m, w: QuantWeight) -> torch.Tensor:
    """ggml's product without its activation rounding: rows ``x`` and ``x - q(x)`` (``q``: the
    rounding ggml's product applies, by ggml's own quantizer) in one ``mul_mat``, summed.
    W q(x) + W q(x - q(x)) leaves about 1/200 of ggml's error (0.43 % -> 0.0024 % on the
    default model's Q8_0 LM head); the weights are read once, the arithmetic doubles."""
    from runtime.kernels import ggml_ops

    x = x.float().contiguous()
    M = x.shape[0]
    y = m(torch.cat([x, x - ggml_ops.as_ggml_sees(x, w.btype.ggml_type)]))
    return y[:M] + y[M:]


#: Outputs of each row the LM head's kernel (``ggml-head``) computes again without ggml's
#: activation rounding: the largest, where a choice of token is made.
HEAD_EXACT_TOP = 128


def _ggml_head_run(x: torch.Tensor, m, w: QuantWeight) -> torch.Tensor:
    """The LM head: ggml's product (the activations rounded per block, as every decode product),
    then each row's :data:`HEAD_EXACT_TOP` largest logits again without that rounding:
    ``W[top] (x - q(x))`` added, those rows of ``W`` widened (a small float32 product). The top
    logits are then ``W x`` to float32 rounding: the rounding's 0.43 % relative error on the
    default model's Q8_0 head flips its answer to "What is the capital of France?" (a gap of
    0.08 between "The" and "L"), and an exact token further down would need an error larger than
    the gap between the largest and the 128th logit. The weights are read once and the
    arithmetic is one row's (``ggml-exact`` does a second row: 1.5x the time on Gemma 3's
    262,144-row head)."""
    from runtime.kernels import ggml_ops

    x = x.float().contiguous()
    y = m(x)
    if w.rows <= HEAD_EXACT_TOP:
        return _ggml_exact_run(x, m, w)
    rest = x - ggml_ops.as_ggml_sees(x, w.btype.ggml_type)   # (M, cols): what the rounding lost
    top = top_indices(y, HEAD_EXACT_TOP)                        # (M, K)
    rows = lookup(w, top)                                       # (M, K, cols) float32
    # one matrix-vector product per row, not a bmm over the rows: a row's correction then does
    # not depend on how many rows share the call (a batched reply equals it alone, bit for bit)
    y.scatter_add_(-1, top, torch.stack([rows[i] @ rest[i] for i in range(rows.shape[0])]))
    return y


#: Logits a chunk of :func:`top_indices`' first pass; rows shorter than 64 chunks of ``k`` take ``topk`` alone.
_TOP_CHUNK = 256


def top_indices(y: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``(M, k)``: each row of ``y (M, V)``'s ``k`` largest, the set ``y.topk(k)`` gives
    (in descending order). Why not ``topk`` alone: over Gemma 3's 262,144 logits it took 0.5-0.9
    ms of a 21 ms token (Intel Xeon). The maxima of chunks of :data:`_TOP_CHUNK` come first: the
    ``k``-th largest of them, ``t``, is at most the row's ``k``-th largest value (those ``k`` chunks
    each hold one at least ``t``), so the values at least ``t`` hold the ``k`` largest, and ``topk``
    runs over them alone."""
    V = y.shape[-1]
    if V < 64 * k:
        return y.topk(k, dim=-1).indices
    main = V // _TOP_CHUNK * _TOP_CHUNK
    out = []
    for row in y:
        t = row[:main].view(-1, _TOP_CHUNK).amax(dim=1).topk(k).values[-1]
        held = (row >= t).nonzero().view(-1)
        out.append(held[row[held].topk(k).indices])
    return torch.stack(out)


def _ggml_available() -> bool:
    from runtime.kernels import ggml_ops

    return ggml_ops.available()


def _int4_prepare(dtype: torch.dtype):
    def prepare(w: QuantWeight, device: torch.device):
        return w.form(f"int4-cpu-{str(dtype).removeprefix('torch.')}")

    return prepare


def _int4_run(dtype: torch.dtype):
    def run(x: torch.Tensor, form, w: QuantWeight) -> torch.Tensor:
        packed, sz = form
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, 32, sz).to(torch.float32)

    return run


def _tinygemm_run(x: torch.Tensor, form, w: QuantWeight) -> torch.Tensor:
    packed, sz = form
    return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), packed, 32, sz).to(torch.float32)


def _int8_run(x: torch.Tensor, form, w: QuantWeight) -> torch.Tensor:
    codes, scale = form
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.float32), codes, scale)


def _f16_prepare(w: QuantWeight, device: torch.device):
    """float16 ``(rows, cols)``, widened a block of rows at a time (never a float32 copy of it all)."""
    W = torch.empty(w.rows, w.cols, dtype=torch.float16, device=device)
    step = max(1, SCRATCH_ELEMENTS // w.cols)
    for r0 in range(0, w.rows, step):
        n = min(step, w.rows - r0)
        W[r0 : r0 + n] = widen(w, rows=slice(r0, r0 + n), out=_scratch_rows(n, w.cols))
    return W


#: Take the kernels' device branches (torch's own ops on the operands' device: no ggml, no
#: oneDNN, no per-thread scratch buffer) on CPU tensors too: what a GPU runs, set by the tests
#: to check that path here (as ``QuantEmbedding.to_device(..., torch_decode=True)`` does).
#: :func:`_cpu_branch` is this module's one test of a device.
torch_ops: bool = False


def _cpu_branch(t: torch.Tensor) -> bool:
    """Whether a kernel takes its CPU branch for operands on ``t``'s device (not with :data:`torch_ops`)."""
    return on_cpu(t) and not torch_ops


def _f16_run(x: torch.Tensor, W: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """float32 ``x (M, cols) @ W.T`` for ``W`` float16 ``(rows, cols)``: torch's float16 product for
    one row or off the CPU (activations rounded to float16), oneDNN's float32 one on the widened
    rows for several on the CPU."""
    if x.shape[0] == 1 or not _cpu_branch(W):
        return F.linear(x.to(torch.float16), W).to(torch.float32)
    from runtime.kernels import cpu

    return cpu.widened_product(cpu._onednn, x, W, None, None)


#: Weights the widening kernels dequantize at a time, into a per-thread float32 scratch
#: buffer (16 MiB): a bigger matrix goes through it a block of rows at a time.
SCRATCH_ELEMENTS = 1 << 22
_scratch = threading.local()


def _scratch_rows(n: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's scratch buffer of ``dtype`` as ``(n, cols)`` (grown when too small)."""
    name = f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < n * cols:
        with torch.inference_mode(False):
            buf = torch.empty(max(n * cols, SCRATCH_ELEMENTS), dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[: n * cols].view(n, cols)


def _float_product(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """float32 ``x @ W.T`` with the CPU's fastest float32 product (oneDNN's inner product where it works)."""
    from runtime.kernels import cpu

    return cpu._onednn(x, W, None)


def _widen_run(x: torch.Tensor, form, w: QuantWeight) -> torch.Tensor:
    """Dequantize a block of rows at a time into the scratch buffer, a float32 product each."""
    x = x.float()
    on_cpu = _cpu_branch(x)
    step = max(1, SCRATCH_ELEMENTS // w.cols)
    if step >= w.rows and on_cpu:
        return _float_product(x, widen(w, out=_scratch_rows(w.rows, w.cols)))
    out = x.new_empty((x.shape[0], w.rows), dtype=torch.float32)
    for r0 in range(0, w.rows, step):
        r = slice(r0, min(r0 + step, w.rows))
        if on_cpu:
            out[:, r] = _float_product(x, widen(w, rows=r, out=_scratch_rows(r.stop - r0, w.cols)))
        else:  # a device: each block widened on the host, copied over, torch's float32 product there
            out[:, r] = F.linear(x, widen(w, rows=r).to(x.device))
    return out


def _bf16_available() -> bool:
    from runtime.kernels import onednn

    return onednn.takes_bfloat16()


def _widen_bf16_run(x: torch.Tensor, form, w: QuantWeight) -> torch.Tensor:
    """``widen``'s blocks of rows, each rounded to bfloat16 (a second scratch buffer), and
    oneDNN's bfloat16 product (float32 accumulation) on the activations rounded to bfloat16;
    its bfloat16 result widened back. Where the CPU multiplies bfloat16 natively (AVX512-BF16,
    AMX) this doubles the float32 product's rate on a prompt's rows; the roundings (weights'
    and activations' 8-bit mantissas, about 0.3 % of a product's largest value) are what
    int4pack-bf16 has, and the default-answer test asks this pair too."""
    from runtime.kernels import onednn

    op = onednn.linear_op(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    step = max(1, SCRATCH_ELEMENTS // w.cols)
    out = x.new_empty((x.shape[0], w.rows), dtype=torch.float32)
    for r0 in range(0, w.rows, step):
        r = slice(r0, min(r0 + step, w.rows))
        n = r.stop - r0
        wb = _scratch_rows(n, w.cols, torch.bfloat16)
        wb.copy_(widen(w, rows=r if n < w.rows else None, out=_scratch_rows(n, w.cols)))
        out[:, r] = op(xb, wb, None, "none", [None], "")
    return out


def _four_bit(t: BlockType) -> bool:
    """A type int4pack takes: 4-bit linear codes in groups of 32 (not IQ4_NL's or MXFP4's codebooks)."""
    return t.linear_codes and t.bits == 4 and t.group == 32


QUANT_KERNELS: dict[str, QuantKernel] = {k.name: k for k in (
    QuantKernel("ggml", ("cpu",), lambda t: True, _ggml_prepare, _ggml_run, _ggml_available),
    QuantKernel("ggml-exact", ("cpu",), lambda t: t.quantized, _ggml_prepare, _ggml_exact_run, _ggml_available),
    QuantKernel("ggml-head", ("cpu",), lambda t: t.quantized, _ggml_prepare, _ggml_head_run, _ggml_available),
    QuantKernel("int4pack-bf16", ("cpu",), _four_bit, _int4_prepare(torch.bfloat16), _int4_run(torch.bfloat16)),
    QuantKernel("int4pack-f16", ("cpu",), _four_bit, _int4_prepare(torch.float16), _int4_run(torch.float16)),
    QuantKernel("int4pack-cuda", ("cuda",), _four_bit, lambda w, d: w.form("int4-cuda", d), _tinygemm_run),
    QuantKernel("int8pack", ("cpu", "cuda"), lambda t: t.quantized, lambda w, d: w.form("int8-rows", d), _int8_run),
    QuantKernel("f16", ("cpu", "cuda", "mps"), lambda t: True, _f16_prepare, _f16_run),
    QuantKernel("widen", ("cpu", "cuda", "mps"), lambda t: True, lambda w, d: None, _widen_run),
    QuantKernel("widen-bf16", ("cpu",), lambda t: t.quantized, lambda w, d: None, _widen_bf16_run, _bf16_available),
)}


def candidates(btype: BlockType, device: str | torch.device = "cpu") -> list[str]:
    """Kernels that take ``btype`` on ``device``'s type and can run in this process, in
    :data:`QUANT_KERNELS`' order."""
    kind = torch.device(device).type
    return [k.name for k in QUANT_KERNELS.values() if kind in k.devices and k.takes(btype) and k.available()]


#: One form made at a time: a load's background builder (:mod:`runtime.model.prefill_forms`)
#: and a caller on another thread asking for the same form make it once.
_FORMS_LOCK = threading.Lock()


def prepared(w: QuantWeight, kernel: str, device: str | torch.device = "cpu"):
    """``kernel``'s form of ``w`` (made and kept on first use). ``w.prepared`` is replaced by a
    new dict, not changed in place: another thread may be reading it (``extra_bytes``)."""
    if kernel in w.prepared:
        return w.prepared[kernel]
    with _FORMS_LOCK:
        if kernel not in w.prepared:
            form = QUANT_KERNELS[kernel].prepare(w, torch.device(device))
            w.prepared = {**w.prepared, kernel: form}
        return w.prepared[kernel]


def quant_linear(x: torch.Tensor, w: QuantWeight, kernel: str, bias: torch.Tensor | None = None,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """``x (..., cols) @ W.T + bias`` -> float32 ``(..., rows)`` with ``kernel``.

    Raises:
        KeyError: an unknown kernel.
    """
    k = QUANT_KERNELS[kernel]
    shape = x.shape
    y = k.run(_rows2d(x), prepared(w, kernel, device), w)
    y = y.view(*shape[:-1], w.rows)
    return y if bias is None else y + bias


# ---- inside torch.compile ---------------------------------------------------------------------
_WEIGHTS: "weakref.WeakValueDictionary[int, QuantWeight]" = weakref.WeakValueDictionary()
_IDS: dict[int, int] = {}  # id(weight) -> its key in _WEIGHTS
_OP = None


def weight_key(w: QuantWeight) -> int:
    """A small int naming ``w`` for :func:`compiled_linear` (weights are held weakly)."""
    key = _IDS.get(id(w))
    if key is None or _WEIGHTS.get(key) is not w:
        key = len(_IDS) + 1
        while key in _WEIGHTS:
            key += 1
        _IDS[id(w)] = key
        _WEIGHTS[key] = w
    return key


def compiled_linear():
    """``torch.ops.attnchat.quant_linear(x, key, kernel)``: :func:`quant_linear` as one opaque op
    for ``torch.compile`` (defined on first call; ``key`` from :func:`weight_key`). Inductor
    cannot trace ctypes calls or repacked operands; as an opaque op the compiled decode step
    calls the chosen kernel as the eager one does (as it calls oneDNN's inner product)."""
    global _OP
    if _OP is None:
        @torch.library.custom_op("attnchat::quant_linear", mutates_args=())
        def op(x: torch.Tensor, key: int, kernel: str) -> torch.Tensor:
            return quant_linear(x, _WEIGHTS[key], kernel, device=x.device)

        @op.register_fake
        def _(x: torch.Tensor, key: int, kernel: str) -> torch.Tensor:
            return x.new_empty((*x.shape[:-1], _WEIGHTS[key].rows), dtype=torch.float32)

        _OP = torch.ops.attnchat.quant_linear
    return _OP


_LOOKUP_OP = None


def compiled_lookup():
    """``torch.ops.attnchat.quant_lookup(ids, key)``: :func:`lookup` as one opaque op for
    ``torch.compile`` (``key`` from :func:`weight_key`)."""
    global _LOOKUP_OP
    if _LOOKUP_OP is None:
        @torch.library.custom_op("attnchat::quant_lookup", mutates_args=())
        def op(ids: torch.Tensor, key: int) -> torch.Tensor:
            return lookup(_WEIGHTS[key], ids)

        @op.register_fake
        def _(ids: torch.Tensor, key: int) -> torch.Tensor:
            return ids.new_empty((*ids.shape, _WEIGHTS[key].cols), dtype=torch.float32)

        _LOOKUP_OP = torch.ops.attnchat.quant_lookup
    return _LOOKUP_OP
