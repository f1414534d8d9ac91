"""CPU matrix-product kernels for the decoder's linear layers, chosen by timing them on this machine.

Must not import Qt. Nothing is probed or timed at import time.

Why measure instead of deciding once: CPU kinds differ. On an AMD EPYC (Zen 4) VM,
oneDNN's inner product read float32 weights at 24 GB/s and MKL's GEMV (``F.linear``) at
10; on an Intel Xeon with AMX both read 17.6 GB/s and torch's float16 GEMV was slower
than float32. So where several kernels compute the same product, each is
timed on the model's own matrices once, on the first load on a machine, and the choice
is kept in a small JSON file beside the converted weights, keyed by the CPU's model
name, its flags, the torch version and the thread count
(:func:`runtime.kernels.machine.machine_key`), by the one chooser
(:func:`runtime.kernels.chooser.load_or_measure`) through :class:`FloatKernels`.

A choice is one kernel for one-token products (decode: every weight read once per
token, memory-bound) and one for several tokens (prefill: compute-bound), per weight
dtype. Every candidate returns ``x @ W.T + b`` in float32 (or bfloat16 for bfloat16
weights) from the same weights; they differ in speed only. ``int8-dynamic`` (fbgemm's
dynamically quantized linear: activations rounded to 7 bits per call) is kept as a kernel
but is no candidate: it was 15x faster than the weight-only int8 kernels on an AMD EPYC
Zen 3, but the default model then agreed with float32 on only 83.6 % of greedy tokens
(mean |logit difference| 0.72) and no longer answered "Paris".
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from runtime.kernels.chooser import best_time_us
from runtime.kernels.cpu import KERNELS, WeightRef
from runtime.kernels.invariant import two_rows
from runtime.kernels.machine import cpu_info

log = logging.getLogger(__name__)

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
    #: The reproducible mode (:func:`runtime.kernels.reproducible.reproducible_choice`):
    #: ``prefill`` runs every row count, under :data:`runtime.kernels.invariant.RULE`.
    reproducible: bool = False
    #: Why this kernel (the reproducible mode: which kernels failed the check here and how).
    reason: str = field(default="", compare=False)


#: weight dtype -> phase -> candidate kernels, the first the default when nothing is measured.
CANDIDATES: dict[torch.dtype, dict[str, tuple[str, ...]]] = {
    torch.float32: {"decode": ("onednn", "mkl"), "prefill": ("onednn", "mkl")},
    # bfloat16 weights compute in float32 (bfloat16 arithmetic breaks the default model)
    torch.bfloat16: {"decode": ("bf16-gemv", "widen-onednn"), "prefill": ("widen-onednn", "widen-mkl")},
    torch.float16: {"decode": ("f16-gemv", "widen-onednn"), "prefill": ("widen-onednn", "widen-mkl")},
    torch.int8: {"decode": ("int8pack", "widen-onednn"), "prefill": ("widen-onednn", "widen-mkl", "int8pack")},
}


@dataclass
class FloatKernels:
    """The float matrices' side of :class:`runtime.kernels.chooser.KernelChooser`: the choice for
    ``weight_dtype``, measured by ``measure_fn`` (e.g. :func:`measure` on a decoder's matrices),
    kept in the machine's file under ``"choices"`` by dtype name, with the CPU, torch version and
    threads beside."""

    weight_dtype: torch.dtype
    measure_fn: Callable[[], KernelChoice]
    what = "the kernel choice"
    measurable = True
    busy_runs_defaults = False

    @property
    def _key(self) -> str:
        return str(self.weight_dtype).removeprefix("torch.")

    def default(self) -> KernelChoice:
        """The first candidate of each phase (what runs before or without a measurement)."""
        c = CANDIDATES[self.weight_dtype]
        return KernelChoice(c["decode"][0], c["prefill"][0])

    def measure(self) -> KernelChoice:
        return self.measure_fn()

    def from_kept(self, kept: dict) -> KernelChoice | None:
        c = kept["choices"][self._key]
        cands = CANDIDATES[self.weight_dtype]
        if c["decode"] in cands["decode"] and c["prefill"] in cands["prefill"]:
            return KernelChoice(c["decode"], c["prefill"], timings_us=c.get("timings_us", {}))
        return None

    def keep(self, kept: dict, choice: KernelChoice) -> dict:
        info = cpu_info()
        kept = kept if isinstance(kept.get("choices"), dict) else {}
        kept.update(cpu=info["model"], torch=torch.__version__, threads=torch.get_num_threads())
        kept.setdefault("choices", {})[self._key] = {"decode": choice.decode, "prefill": choice.prefill,
                                                    "timings_us": choice.timings_us}
        return kept


def apply(choice: KernelChoice, x: torch.Tensor, ref: WeightRef, bias: torch.Tensor | None) -> torch.Tensor:
    """``x (..., in) @ ref.weight.T + bias`` with the choice's kernel for ``x``'s row count.

    A reproducible choice runs one kernel for every row count and a single row as the
    first of two unless the kernel's own one-row path is row-invariant too
    (:data:`ONE_ROW_ALONE`): :data:`runtime.kernels.invariant.RULE`.
    """
    one = x.numel() == x.shape[-1]
    if choice.reproducible:
        kernel = KERNELS[choice.prefill]
        if one and choice.prefill not in ONE_ROW_ALONE:
            return two_rows(lambda x2: kernel(x2, ref, bias), x)
        return kernel(x, ref, bias)
    return KERNELS[choice.decode if one else choice.prefill](x, ref, bias)


# ---- the reproducible mode (its kernels: runtime.kernels.reproducible) -----------------------
#: Kernels whose one-row path is row-invariant as well (each output one running sum over
#: ``in`` in order: FBGEMM's float16 product, torch's int8 tinygemm); the others compute a
#: single row as the first of two (oneDNN's one-row path is a matrix-vector kernel that
#: sums in another order: 3.8e-6 apart on the default model's q/k/v matrix).
ONE_ROW_ALONE = frozenset({"fbgemm-f16", "int8pack"})


# ---- measuring ----------------------------------------------------------------------------------
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
                            total += best_time_us(lambda: kernel(x, ref, None), reps, warm_up=True) * count / rows
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

    def one_token():
        for ref in refs:
            kernel(xs[ref.weight.shape[1]], ref, None)

    return best_time_us(one_token, reps, warm_up=True)


def describe(choice: KernelChoice | None) -> dict:
    """JSON-ready: the choice and its timings."""
    return {} if choice is None else asdict(choice)
