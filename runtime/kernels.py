"""CPU matrix-product kernels for the decoder's linear layers, chosen by timing them on this machine.

Must not import Qt. Nothing is probed or timed at import time.

Why measure instead of deciding once: CPU kinds differ. On an AMD EPYC (Zen 4) VM,
oneDNN's inner product read float32 weights at 24 GB/s and MKL's GEMV (``F.linear``) at
10; on an Intel Xeon with AMX both read 17.6 GB/s and torch's float16 GEMV was slower
than float32 (issue 19). So where several kernels compute the same product, each is
timed on the model's own matrices once, on the first load on a machine, and the choice
is kept in a small JSON file beside the converted weights, keyed by the CPU's model
name, its flags, the torch version and the thread count (:func:`machine_key`).

A choice is one kernel for one-token products (decode: every weight read once per
token, memory-bound) and one for several tokens (prefill: compute-bound), per weight
dtype. Every candidate returns ``x @ W.T + b`` in float32 (or bfloat16 for bfloat16
weights) from the same weights; they differ in speed only. ``int8-dynamic`` (fbgemm's
dynamically quantized linear: activations rounded to 7 bits per call) is kept as a kernel
but is no candidate: it was 15x faster than the weight-only int8 kernels on an AMD EPYC
Zen 3, but the default model then agreed with float32 on only 83.6 % of greedy tokens
(mean |logit difference| 0.72) and no longer answered "Paris" (issue 19).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: Bump when kernels or their timing change: older choice files are measured again.
#: 3: bfloat16 weights compute in float32 (new candidates); choices timed on a busy
#: machine are no longer kept (some version-2 files held such choices).
#: 4: decode kernels timed streaming every matrix of a token from memory (version 3
#: timed each shape again and again from the CPU's cache, which hid a 1.5x difference).
CHOICE_VERSION = 4


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a decoder's CPU matrix products use.

    Attributes:
        decode: kernel name for one-row products (a decode step).
        prefill: kernel name for several rows (prefill chunks).
        timings_us: measured microseconds per token for each candidate (``phase`` ->
            ``kernel`` -> us; empty when not measured).
        measured: whether this machine measured it now (False: read from the file).
    """

    decode: str
    prefill: str
    timings_us: dict = field(default_factory=dict, compare=False)
    measured: bool = field(default=False, compare=False)


# ---- the kernels ------------------------------------------------------------------------------
_ONEDNN_OP = False  # the probed op, None without it; False until first needed


def onednn_linear_op():
    """``torch.ops.mkldnn._linear_pointwise`` when this build has it and it computes a known
    product right (probed on first call), else None."""
    global _ONEDNN_OP
    if _ONEDNN_OP is False:
        try:
            if not torch.backends.mkldnn.is_available():
                raise RuntimeError("no oneDNN")
            op = torch.ops.mkldnn._linear_pointwise
            with torch.inference_mode():
                out = op(torch.ones(1, 2), torch.ones(3, 2), None, "none", [None], "")
            _ONEDNN_OP = op if torch.equal(out, torch.full((1, 3), 2.0)) else None
        except (AttributeError, RuntimeError):
            _ONEDNN_OP = None
    return _ONEDNN_OP


_ONEDNN_BF16 = None  # whether oneDNN's inner product takes bfloat16 here; None until probed


def onednn_takes_bfloat16() -> bool:
    """Whether oneDNN's inner product runs bfloat16 on this CPU (probed on first call): it
    needs AVX512-BF16 or AMX; on an AMD Zen 3 (AVX2 only) it refuses to build the primitive."""
    global _ONEDNN_BF16
    if _ONEDNN_BF16 is None:
        op = onednn_linear_op()
        try:
            with torch.inference_mode():
                _ONEDNN_BF16 = op is not None and bool(
                    torch.equal(op(torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16),
                                   None, "none", [None], "").float(), torch.full((1, 3), 2.0)))
        except RuntimeError:
            _ONEDNN_BF16 = False
    return _ONEDNN_BF16


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
    op = onednn_linear_op()
    if op is None or x.dtype != w.dtype or not (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and onednn_takes_bfloat16())):
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


def _int8pack(x, ref, b):
    shape = x.shape
    y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), ref.weight, ref.scale)
    return _add_bias(y.view(*shape[:-1], -1), b)


#: name -> fn(x float32 (..., in), WeightRef, bias float32) -> float32 (..., out). Which
#: weight dtypes each takes is :data:`CANDIDATES`. The decoder runs them only on float32
#: activations (every weight dtype computes in float32 on the CPU by default,
#: :func:`runtime.device.compute_dtype`); other compute dtypes take :func:`runtime.model.linear`.
KERNELS: dict[str, Callable] = {
    "onednn": lambda x, r, b: _onednn(x, r.weight, b),
    "mkl": lambda x, r, b: F.linear(x, r.weight.to(x.dtype), b),
    "f16-gemv": lambda x, r, b: _add_bias(F.linear(x.to(torch.float16), r.weight).to(torch.float32), b),
    "bf16-gemv": lambda x, r, b: _add_bias(F.linear(x.to(torch.bfloat16), r.weight).to(torch.float32), b),
    "widen-onednn": lambda x, r, b: widened_product(_onednn, x, r.weight, r.scale, b),
    "widen-mkl": lambda x, r, b: widened_product(F.linear, x, r.weight, r.scale, b),
    "int8-dynamic": _int8_dynamic,
    "int8pack": _int8pack,
}

#: weight dtype -> phase -> candidate kernels, the first the default when nothing is measured.
CANDIDATES: dict[torch.dtype, dict[str, tuple[str, ...]]] = {
    torch.float32: {"decode": ("onednn", "mkl"), "prefill": ("onednn", "mkl")},
    # bfloat16 weights compute in float32 (bfloat16 arithmetic breaks the default model)
    torch.bfloat16: {"decode": ("bf16-gemv", "widen-onednn"), "prefill": ("widen-onednn", "widen-mkl")},
    torch.float16: {"decode": ("f16-gemv", "widen-onednn"), "prefill": ("widen-onednn", "widen-mkl")},
    torch.int8: {"decode": ("int8pack", "widen-onednn"), "prefill": ("widen-onednn", "widen-mkl", "int8pack")},
}


def default_choice(weight_dtype: torch.dtype) -> KernelChoice:
    """The first candidate of each phase (what runs before or without a measurement)."""
    c = CANDIDATES[weight_dtype]
    return KernelChoice(c["decode"][0], c["prefill"][0])


def apply(choice: KernelChoice, x: torch.Tensor, ref: WeightRef, bias: torch.Tensor | None) -> torch.Tensor:
    """``x (..., in) @ ref.weight.T + bias`` with the choice's kernel for ``x``'s row count."""
    name = choice.decode if x.numel() == x.shape[-1] else choice.prefill
    return KERNELS[name](x, ref, bias)


# ---- the machine ------------------------------------------------------------------------------
def cpu_info() -> dict:
    """``{"model": CPU model name, "flags": [sorted flags], "capability": torch's ISA level}``
    (``/proc/cpuinfo`` on Linux; the flags list is empty elsewhere)."""
    import platform

    name, flags = "", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = sorted(line.split(":", 1)[1].split())
                if name and flags:
                    break
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older builds
        capability = "unknown"
    return {"model": name or platform.processor() or platform.machine(), "flags": flags, "capability": capability}


#: The CPU flags that decide between kernels (shown by ``attnchat bench``).
NOTABLE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                 "amx_bf16", "amx_int8", "amx_tile")


def machine_key() -> str:
    """A short hash of what decides the kernels' speed: CPU model and flags, torch version, threads."""
    info = cpu_info()
    from runtime.threads import max_threads

    raw = json.dumps([CHOICE_VERSION, info["model"], info["flags"], torch.__version__, max_threads()])
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


# ---- measuring ----------------------------------------------------------------------------------
def _time_us(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(
    matrices: list[tuple[WeightRef, int]], weight_dtype: torch.dtype, *, prefill_rows: int = 64, reps: int = 5,
    prefill_matrices: list[tuple[WeightRef, int]] | None = None,
    token_matrices: list[WeightRef] | None = None,
) -> KernelChoice:
    """Time every candidate kernel for ``weight_dtype`` and pick the fastest per phase.

    Decode (one row) is timed as a token meets the weights: every matrix of
    ``token_matrices`` once, in order, so each is read from memory, not from the CPU's
    cache. Timing one matrix of each shape again and again, as prefill is timed, keeps
    the small matrices in the cache: on an AMD EPYC Zen 3 (2 cores) MKL's and oneDNN's
    float32 GEMV then timed alike (27.3 against 27.1 ms per token) while streaming the
    default model's 540 MB they took 47.8 and 31.6 ms.

    Args:
        matrices: ``(matrix, times per token)`` pairs: one of each distinct shape, with how
            many of it a token passes through (layers for a block's matrix, 1 for the head).
            Decode is timed on these (cache-hot) only without ``token_matrices``.
        weight_dtype: the weights' dtype (a key of :data:`CANDIDATES`).
        prefill_rows: rows of the several-token timing.
        reps: timings per candidate (the minimum is kept: other processes only ever make
            a run slower).
        prefill_matrices: for the several-token timing (default ``matrices``; the head
            sees one row per prefill chunk, so callers leave it out).
        token_matrices: every matrix one token passes through, in order (all layers' and
            the head), for the decode timing.

    Returns:
        the fastest per phase, by microseconds per token. A candidate that raises (a build
        without the op) is skipped.
    """
    timings: dict[str, dict[str, float]] = {}
    chosen = {}
    for phase, rows, mats in (("decode", 1, matrices), ("prefill", prefill_rows, prefill_matrices or matrices)):
        per = {}
        for name in CANDIDATES[weight_dtype][phase]:
            kernel = KERNELS[name]
            try:
                with torch.inference_mode():
                    if phase == "decode" and token_matrices:
                        total = _time_stream_us(kernel, token_matrices, reps)
                    else:
                        total = 0.0
                        for ref, count in mats:
                            x = torch.randn(1, rows, ref.weight.shape[1])
                            kernel(x, ref, None)  # warm-up (and prepacking)
                            total += _time_us(lambda: kernel(x, ref, None), reps) * count / rows
            except (RuntimeError, NotImplementedError, AttributeError) as e:
                log.info("kernel %s unavailable here: %s", name, e)
                continue
            per[name] = round(total, 1)
        timings[phase] = per
        chosen[phase] = min(per, key=per.get) if per else CANDIDATES[weight_dtype][phase][0]
    return KernelChoice(chosen["decode"], chosen["prefill"], timings_us=timings, measured=True)


def _time_stream_us(kernel: Callable, refs: list[WeightRef], reps: int) -> float:
    """Best of ``reps`` microseconds for one row through every matrix of ``refs`` in order
    (after one untimed pass: warm-up and any prepacking)."""
    xs = {}
    for ref in refs:
        n = ref.weight.shape[1]
        if n not in xs:
            xs[n] = torch.randn(1, 1, n)
    for ref in refs:
        kernel(xs[ref.weight.shape[1]], ref, None)

    def one_token():
        for ref in refs:
            kernel(xs[ref.weight.shape[1]], ref, None)

    return _time_us(one_token, reps)


def load_or_measure(
    folder: Path | None, weight_dtype: torch.dtype, measure_fn: Callable[[], KernelChoice]
) -> KernelChoice:
    """The choice kept in ``folder`` for this machine and dtype, else ``measure_fn()`` (kept
    there for next time). ``folder`` None: measured, not kept. ``ATTNCHAT_KERNELS=default``
    skips measuring (the first candidates); ``ATTNCHAT_KERNELS=measure`` measures again and
    replaces the kept choice (a choice timed while other programs loaded the CPU can be off)."""
    mode = os.environ.get("ATTNCHAT_KERNELS", "")
    if mode == "default":
        return default_choice(weight_dtype)
    dtype_key = str(weight_dtype).removeprefix("torch.")
    path = None if folder is None else folder / f"kernels-{machine_key()}.json"
    kept: dict = {}
    if path is not None and path.exists():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            c = kept["choices"][dtype_key]
            cands = CANDIDATES[weight_dtype]
            if c["decode"] in cands["decode"] and c["prefill"] in cands["prefill"] and mode != "measure":
                return KernelChoice(c["decode"], c["prefill"], timings_us=c.get("timings_us", {}))
        except (OSError, ValueError, KeyError, TypeError):
            kept = {} if not isinstance(kept, dict) else kept
    choice = measure_fn()
    load = machine_load()
    if load is not None and load >= (os.cpu_count() or 1):
        # Other programs had the cores: the timings may be off by orders of magnitude
        # (oneDNN's GEMV timed at 45 ms instead of 0.2 on a 2-core AMD EPYC Zen 3 at load
        # 5). Used for this run, measured again next time.
        log.info("kernel choice not kept: measured at load %.1f on %d CPUs", load, os.cpu_count() or 1)
        return choice
    if path is not None and path.parent.exists():
        info = cpu_info()
        kept = kept if isinstance(kept.get("choices"), dict) else {}
        kept.update(cpu=info["model"], torch=torch.__version__, threads=torch.get_num_threads())
        kept.setdefault("choices", {})[dtype_key] = {"decode": choice.decode, "prefill": choice.prefill,
                                                    "timings_us": choice.timings_us}
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(kept, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            log.warning("could not keep the kernel choice", exc_info=True)
            tmp.unlink(missing_ok=True)
    return choice


def machine_load() -> float | None:
    """The 1-minute load average (runnable processes; None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def describe(choice: KernelChoice | None) -> dict:
    """JSON-ready: the choice and its timings."""
    return {} if choice is None else asdict(choice)
