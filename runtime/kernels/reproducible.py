"""The reproducible mode's kernels, chosen by checking them on this machine.

Must not import Qt. Nothing is checked at import time.

Why check on the machine: whether a library's product gives a row the same bits for every
row count (:data:`runtime.kernels.invariant.RULE`) depends on the code it runs, and that
depends on the CPU. FBGEMM's float16 product is row-invariant with its AVX-512 kernels
(Intel Xeon, AMD EPYC Zen 4: 1-257 rows, 1 and 2 threads, bitwise) and not with its AVX2
ones (AMD EPYC Zen 3, or Zen 4 with ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``: rows 1.5e-6 to
3.8e-6 apart between 1 and 2 rows). So every candidate of :data:`REPRODUCIBLE` is checked
(:func:`runtime.kernels.invariant.rows_invariant`) on the model's own matrices under every
thread count the governors may choose, the first that passes is used, and the verdicts are
kept per machine beside the kernel choice (``kernels-<machine key>.json``, its
``"reproducible"`` section), so the check runs once per machine and model folder.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import torch

from runtime.kernels.choice import KernelChoice, apply
from runtime.kernels.cpu import WeightRef, fbgemm_f16_available
from runtime.kernels.invariant import rows_invariant
from runtime.kernels.machine import keep_json, kernel_file

log = logging.getLogger(__name__)

#: weight dtype -> the kernels the reproducible mode may run, preferred first (the fastest
#: where it holds): each computes every output as one running sum over its input on the
#: CPUs measured, one row included. MKL's products are not row-invariant anywhere measured
#: (a row differs between 2-15 rows and 16+); neither are the 16-bit matrix-vector kernels,
#: which also round the activations. ``fbgemm-f16`` keeps a packed copy of the weights
#: (1.78x their float16 bytes for the default model's 576-wide rows: +417 MiB);
#: ``widen-onednn`` widens float16 weights to float32 per product (no copy).
REPRODUCIBLE: dict[torch.dtype, tuple[str, ...]] = {
    torch.float32: ("onednn",),
    torch.float16: ("fbgemm-f16", "widen-onednn"),
    torch.bfloat16: ("widen-onednn",),
    torch.int8: ("int8pack", "widen-onednn"),
}

#: Output rows of each matrix the check multiplies (the first ones): the rule is about the
#: activation rows a product takes, and the model's full LM head (49,152 rows) would make
#: the check take seconds.
CHECK_OUT_ROWS = 512


def reproducible_choice(
    weight_dtype: torch.dtype,
    refs: Iterable[WeightRef] = (),
    *,
    threads: tuple[int, ...] = (),
    folder: Path | None = None,
) -> KernelChoice:
    """The reproducible mode's kernel for ``weight_dtype``: the first of :data:`REPRODUCIBLE`
    that runs here and passes :func:`runtime.kernels.invariant.rows_invariant` on each
    distinct input width of ``refs`` (the model's own matrices) under each thread count of
    ``threads``. Verdicts kept in ``folder`` for this machine are used instead of checking
    again; new ones are kept there (``folder`` None: checked, not kept).

    Returns:
        a reproducible :class:`KernelChoice` whose ``reason`` says which kernel runs and why
        the ones before it do not (e.g. ``"widen-onednn (row-invariant here); fbgemm-f16: rows
        differ here (2 rows, 1 threads: 3.6e-06 apart)"``).

    Raises:
        ValueError: no kernel passes here (the reason of each, in one line).
    """
    refs = _one_per_width(refs)
    widths = sorted(refs)
    dtype_key = str(weight_dtype).removeprefix("torch.")
    path = kernel_file(folder)
    kept = _read(path)
    section = kept["reproducible"].get(dtype_key)
    if not isinstance(section, dict):
        section = kept["reproducible"][dtype_key] = {}
    failures, changed = [], False
    for name in REPRODUCIBLE[weight_dtype]:
        if name == "fbgemm-f16" and not fbgemm_f16_available():
            failures.append(f"{name}: not in this torch build")
            continue
        choice = KernelChoice(name, name, reproducible=True)
        verdict = section.get(name)
        if not (isinstance(verdict, dict) and verdict.get("widths") == widths
                and verdict.get("threads") == sorted(threads) and isinstance(verdict.get("failures"), list)):
            bad = []
            for width in widths:
                bad += [f"{width} wide, {f}" for f in
                        rows_invariant(lambda x2, c=choice, r=refs[width]: apply(c, x2, r, None), width,
                                       threads=threads)]
            verdict = section[name] = {"widths": widths, "threads": sorted(threads), "failures": bad[:3]}
            changed = True
            log.info("reproducible mode: %s %s on this machine", name,
                     "is row-invariant" if not bad else f"is not row-invariant ({bad[0]})")
        if verdict["failures"]:
            failures.append(f"{name}: rows differ here ({verdict['failures'][0]})")
            continue
        if changed and path is not None and path.parent.exists():
            keep_json(path, kept, "the reproducible mode's verdicts")
        checked = "row-invariant here" if widths else "not checked"
        reason = "; ".join([f"{name} ({checked})"] + failures)
        return KernelChoice(name, name, reproducible=True, reason=reason)
    if changed and path is not None and path.parent.exists():
        keep_json(path, kept, "the reproducible mode's verdicts")
    raise ValueError("no row-invariant kernel for " + dtype_key + " weights here: " + "; ".join(failures))


def _one_per_width(refs: Iterable[WeightRef]) -> dict[int, WeightRef]:
    """``input width -> a fresh WeightRef`` of the first :data:`CHECK_OUT_ROWS` rows of the
    first matrix of that width (fresh: a kernel packs its own copy of the slice)."""
    out: dict[int, WeightRef] = {}
    for r in refs:
        width = int(r.weight.shape[1])
        if width not in out:
            scale = None if r.scale is None else r.scale[:CHECK_OUT_ROWS]
            out[width] = WeightRef(r.weight[:CHECK_OUT_ROWS].contiguous(), scale)
    return out


def _read(path: Path | None) -> dict:
    """The kept kernel file as a dict (empty when absent or unreadable)."""
    if path is None or not path.exists():
        return {"reproducible": {}}
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"reproducible": {}}
    if not isinstance(kept, dict):
        return {"reproducible": {}}
    if not isinstance(kept.get("reproducible"), dict):
        kept["reproducible"] = {}
    return kept
