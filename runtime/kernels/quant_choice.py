"""Choosing the quantized kernels per machine and block type: the ``(decode,
prefill)`` pairs each type may run (:func:`kernel_pairs`), timing them on the model's own
matrices (:func:`measure_quant`), and the blocks' side of the one chooser
(:class:`BlockKernels` for :func:`runtime.kernels.chooser.load_or_measure`: kept per machine
beside the GGUF's config). Must not import Qt, transformers or the weights package (the
kernels read weights by their attributes: :mod:`runtime.kernels.quantized`).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from runtime.kernels.chooser import best_time_us
from runtime.kernels.quantized import QUANT_KERNELS, BlockType, QuantWeight, _four_bit, quant_linear

log = logging.getLogger(__name__)


def kernel_pairs(btype: BlockType, device: str | torch.device = "cpu") -> list[tuple[str, str]]:
    """The ``(decode, prefill)`` kernel pairs tried for ``btype`` on ``device``, the default first.

    The blocks themselves are always held; a pair adds at most one form beside them: ggml
    decodes from the raw blocks and prefill widens the same blocks (or runs ``ggml-exact``
    on them); int4pack repacks once, for both or (after ggml's decode) for prefill only. Without ggml the CPU runs torch's int4pack on
    4-bit types and a float16 copy for the others (twice to four times their bytes), and
    says so once. CUDA: tinygemm for 4-bit types, a float16 copy for the others.

    Prefill never runs ggml's rounded product (activations to 8 bits per block): the
    prompt's products decide a reply's first token, where a small model's openings are
    near-ties. The default model's "What is the capital of France?" (float32 logits "The"
    25.325, "L" 25.243) answered "L'Étoile, la Cité, la Nation" with its Q4_1 prompt
    products through ggml (its AVX2 kernels on an AMD EPYC Zen 3, its AVX-512 ones on a
    Zen 4) and "The capital of France is Paris." with them widened or through
    ``ggml-exact``, decode rounded or not (tests/runtime/loader/test_default_answers.py
    asks every pair).
    """
    kind = torch.device(device).type
    four = _four_bit(btype)
    if not btype.quantized:
        return [("widen", "widen")] if kind == "cpu" else [("f16", "f16")]
    if kind == "cuda":
        return [("int4pack-cuda", "int4pack-cuda")] if four else [("f16", "f16")]
    if kind != "cpu":
        return [("f16", "f16")]
    pairs = []
    if QUANT_KERNELS["ggml"].available():
        pairs += [("ggml", "widen"), ("ggml", "ggml-exact")]
        if QUANT_KERNELS["widen-bf16"].available():
            pairs.append(("ggml", "widen-bf16"))
        if four:   # the ggml decode step reads the blocks, int4pack's repack prefills
            pairs.append(("ggml", "int4pack-bf16"))
    if four:
        pairs.append(("int4pack-bf16", "int4pack-bf16"))
    if not pairs:
        _say_once("ggml-python is not installed: 5-, 6- and 8-bit GGUF matrices run as float16 copies "
                  "(torch's kernels), 4-bit ones through torch's int4pack")
        pairs.append(("f16", "f16"))
    return pairs


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        log.warning(message)


@dataclass(frozen=True)
class QuantChoice:
    """The kernels per block type: ``kernels[type name] = (decode kernel, prefill kernel)``.

    Attributes:
        kernels: as above.
        short_rows: per type, the most rows a prefill product runs through :data:`SHORT_KERNEL`
            instead of the type's prefill kernel (a short prompt or a follow-up turn); 0 or
            absent: never (:func:`measure_quant` times where it is faster).
        timings_us: measured microseconds per token: ``type -> phase -> kernel -> us`` (empty
            when not measured).
        measured: whether it was timed now (False: the defaults, or read from a file).
    """

    kernels: dict[str, tuple[str, str]]
    timings_us: dict = field(default_factory=dict, compare=False)
    measured: bool = field(default=False, compare=False)
    short_rows: dict[str, int] = field(default_factory=dict)

    def kernel(self, btype: BlockType, rows: int) -> str:
        """The kernel for a product of ``rows`` activation rows (1: decode)."""
        decode, prefill = self.kernels[btype.name]
        if rows == 1:
            return decode
        return SHORT_KERNEL if rows <= self.short_rows.get(btype.name, 0) else prefill

    def describe(self) -> dict:
        """JSON-ready: ``{type: {"decode": k, "prefill": k, "short_prefill_rows": n}}`` and the timings."""
        return {"kernels": {t: {"decode": d, "prefill": p, "short_prefill_rows": self.short_rows.get(t, 0)}
                            for t, (d, p) in self.kernels.items()},
                "timings_us": self.timings_us, "measured": self.measured}


def head_choice(choice: QuantChoice) -> QuantChoice:
    """``choice`` for the LM head: ggml's decode with its largest logits computed without its
    activation rounding (``ggml-head``). Why: the default model's answer to "What is the
    capital of France?" hangs on a logit gap of 0.08 between "The" and "L" (float32: 25.325 /
    25.243); ggml's rounding of the head's input (0.43 % relative error in its logits) flips it
    to "L'Étoile, la Marseillaise", the exact top logits keep "The capital of France is Paris."
    (measured on an Intel Xeon, and on an AMD EPYC Zen 4 with ggml built for AVX2 only)."""
    return QuantChoice({t: ("ggml-head" if d == "ggml" else d, p) for t, (d, p) in choice.kernels.items()},
                       timings_us=choice.timings_us, measured=choice.measured, short_rows=choice.short_rows)


def default_quant_choice(btypes, device: str | torch.device = "cpu") -> QuantChoice:
    """The first pair of :func:`kernel_pairs` for each block type of ``btypes``."""
    return QuantChoice({t.name: kernel_pairs(t, device)[0] for t in sorted(btypes, key=lambda t: t.name)})


#: A kernel that holds a repacked copy beside the file's blocks (int4pack) must beat one
#: that reads the blocks themselves by this factor to be chosen: memory is the point of
#: running the file's own blocks.
COPY_MARGIN = 0.9

#: The kernels that read the file's blocks with no form beside them.
COPY_FREE = ("ggml", "ggml-exact", "widen", "widen-bf16")


def _fastest(us: dict[str, float], order: list[str]) -> str:
    """The fastest of ``us`` (the first of ``order`` when nothing was timed); a kernel with a
    copy of the weights only when it takes at most :data:`COPY_MARGIN` of the best copy-free time."""
    if not us:
        return order[0]
    best = min(us, key=us.get)
    free = {k: t for k, t in us.items() if k in COPY_FREE}
    if best not in free and free and us[best] > COPY_MARGIN * min(free.values()):
        return min(free, key=free.get)
    return best


def _pairs_with(pairs: list[tuple[str, str]], decode: str | None) -> list[tuple[str, str]]:
    """``pairs`` whose decode kernel is ``decode`` (all of them without one, or when none is)."""
    if decode is None:
        return pairs
    return [p for p in pairs if p[0] == decode] or pairs


#: Rows of the prefill timing: the app reads a prompt this many tokens a chunk
#: (GenerationSettings.prefill_chunk). At 64 rows a widening kernel's fixed cost (each matrix
#: widened once a call) dominated: on the default model (AMD EPYC Zen 4) int4pack-bf16 timed
#: 1,432 us a token against widen-bf16's 2,328 and was chosen, its repack adding 1.2 s to every
#: load and 66 MB; at 256 rows widen-bf16 takes 895 against 1,480, and the bench's first
#: 512-token prompt read at 326 tok/s against 297.
PREFILL_ROWS = 256

#: The copy-free kernel a short prefill product may run instead of the type's prefill kernel,
#: and the row counts it is timed at against it. Why: a widening kernel widens every matrix
#: once a call, whatever its rows; ggml's products (twice, for the activations' rounding) cost
#: per row. Default model, Q4_1, per token (Intel Xeon, 2 cores): 4 rows widen-bf16 22.5 ms,
#: ggml-exact 6.3; 16 rows 5.7 against 5.1; 32 rows 2.9 against 5.0. A follow-up turn of a
#: chat is often that short.
SHORT_KERNEL = "ggml-exact"
SHORT_ROWS = (4, 8, 16, 32, 64)


def measure_quant(weights: list[QuantWeight], device: str | torch.device = "cpu", *, prefill_rows: int = PREFILL_ROWS,
                  reps: int = 3, prefill_weights: list[QuantWeight] | None = None,
                  decode: str | None = None) -> QuantChoice:
    """Time each block type's kernel pairs on the model's own matrices and keep the fastest.

    Decode: one row through every matrix of the type, in ``weights``' order (a token's:
    each read from memory, not from the CPU's cache), per decode kernel. Prefill:
    ``prefill_rows`` rows through one matrix of each shape of the type (times its count),
    per prefill kernel paired with the chosen decode kernel. Forms made for kernels that
    lose are dropped. Candidates run interleaved, best of ``reps``: other processes only
    ever slow a run down.

    Args:
        weights: every quantized matrix a token passes through, in order (layers, then the head).
        prefill_weights: the matrices prefill multiplies with several rows (default
            ``weights``; the LM head sees one row per prefill chunk, so callers leave it out).
        decode: the decode kernel, fixed (the ggml decode step's ``"ggml"``): only the pairs
            with it are tried, and only their prefill is timed. A type without such a pair
            is measured as without ``decode``.

    Returns:
        the choice, with ``timings_us[type][phase][kernel]`` in microseconds per token.
    """
    by_type: dict[str, list[QuantWeight]] = {}
    for w in weights:
        by_type.setdefault(w.btype.name, []).append(w)
    prefill_set = {id(w) for w in (prefill_weights if prefill_weights is not None else weights)}
    chosen, timings, short = {}, {}, {}
    with torch.inference_mode():
        for tname, ws in by_type.items():
            pairs = _pairs_with(kernel_pairs(ws[0].btype, device), decode)
            decodes = list(dict.fromkeys(d for d, _ in pairs))
            xs = {w.cols: torch.randn(1, w.cols, device=device) for w in ws}
            per: dict[str, dict[str, float]] = {"decode": {}, "prefill": {}}
            if len(decodes) > 1:
                for k in decodes:
                    def token(k=k):
                        for w in ws:
                            quant_linear(xs[w.cols], w, k, device=device)
                    try:
                        per["decode"][k] = round(best_time_us(token, reps, warm_up=True), 1)
                    except (RuntimeError, NotImplementedError) as e:
                        log.info("quantized kernel %s unusable for %s: %s", k, tname, e)
            decode = _fastest(per["decode"], decodes)
            prefills = [p for d, p in pairs if d == decode]
            shapes: dict[tuple[int, int], list[QuantWeight]] = {}
            for w in ws:
                if id(w) in prefill_set:
                    shapes.setdefault(w.shape, []).append(w)
            if len(prefills) > 1 and shapes:
                for k in prefills:
                    total = 0.0
                    for (rows, cols), same in shapes.items():
                        x = torch.randn(prefill_rows, cols, device=device)
                        run = functools.partial(quant_linear, x, same[0], k, device=device)
                        total += best_time_us(run, reps, warm_up=True) * len(same)
                    per["prefill"][k] = round(total / prefill_rows, 1)
            prefill = _fastest(per["prefill"], prefills)
            chosen[tname] = (decode, prefill)
            timings[tname] = per
            if SHORT_KERNEL in prefills and prefill != SHORT_KERNEL and shapes:
                short[tname] = _short_rows(shapes, prefill, reps, device, per)
            for w in ws:
                keep = (decode, prefill, SHORT_KERNEL) if short.get(tname) else (decode, prefill)
                for k in list(w.prepared):
                    if k not in keep:
                        del w.prepared[k]
    return QuantChoice(chosen, timings_us=timings, measured=True, short_rows=short)


def _short_rows(shapes: dict, prefill: str, reps: int, device, per: dict) -> int:
    """The most of :data:`SHORT_ROWS` up to which :data:`SHORT_KERNEL` multiplies ``shapes``
    (shape -> its matrices) faster than ``prefill`` at every count timed (0: not at the first);
    the times go into ``per["short"]`` (``rows -> kernel -> us per token``)."""
    best = 0
    per["short"] = {}
    for rows in SHORT_ROWS:
        us = {}
        for k in (SHORT_KERNEL, prefill):
            total = 0.0
            for (_, cols), same in shapes.items():
                x = torch.randn(rows, cols, device=device)
                total += best_time_us(functools.partial(quant_linear, x, same[0], k, device=device), reps,
                                      warm_up=True) * len(same)
            us[k] = round(total / rows, 1)
        per["short"][str(rows)] = us
        if us[SHORT_KERNEL] >= us[prefill]:
            break
        best = rows
    return best


# ---- kept per machine -----------------------------------------------------------------------
@dataclass
class BlockKernels:
    """The blocks' side of :class:`runtime.kernels.chooser.KernelChooser`: a pair per block type of
    ``btypes`` on ``device``, measured by ``measure_fn`` (e.g. :func:`measure_quant`), kept in the
    machine's file (the float kernels' too) under ``"quant"`` by type name. Off the CPU: the
    defaults (one pair per type there); on a busy machine: the copy-free defaults, unmeasured.
    ``decode``: the decode kernel fixed (:func:`measure_quant`'s), such a choice kept in its own
    section (``"quant-decode-ggml"``)."""

    btypes: frozenset | set
    device: str | torch.device
    measure_fn: Callable[[], QuantChoice]
    decode: str | None = None
    what = "the quantized kernel choice"
    busy_runs_defaults = True

    @property
    def measurable(self) -> bool:
        return torch.device(self.device).type == "cpu"

    def default(self) -> QuantChoice:
        return default_quant_choice(self.btypes, self.device)

    def measure(self) -> QuantChoice:
        return self.measure_fn()

    def from_kept(self, kept: dict) -> QuantChoice | None:
        names = sorted({t.name for t in self.btypes})
        section = kept.get(self.section, {})
        pairs = {t.name: _pairs_with(kernel_pairs(t, self.device), self.decode) for t in self.btypes}
        if all(n in section and tuple(section[n]["pair"]) in pairs[n] and "short_rows" in section[n] for n in names):
            return QuantChoice({n: tuple(section[n]["pair"]) for n in names},
                               timings_us={n: section[n].get("timings_us", {}) for n in names},
                               short_rows={n: int(section[n]["short_rows"]) for n in names})
        return None   # not measured here, or before short prefills were timed: measured (again)

    @property
    def section(self) -> str:
        """The part of the machine's file this choice is kept in."""
        return "quant" if self.decode is None else f"quant-decode-{self.decode}"

    def keep(self, kept: dict, choice: QuantChoice) -> dict:
        section = kept.setdefault(self.section, {})
        for n, pair in choice.kernels.items():
            section[n] = {"pair": list(pair), "timings_us": choice.timings_us.get(n, {}),
                          "short_rows": choice.short_rows.get(n, 0)}
        return kept
