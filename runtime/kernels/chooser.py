"""One kernel chooser for every kind of weights: the choice kept for this machine, else
measured now and kept for next time.

Must not import Qt. Nothing is timed at import time.

A kind of weights (float matrices, :class:`runtime.kernels.choice.FloatKernels`; a GGUF's
blocks, :class:`runtime.kernels.quant_choice.BlockKernels`) says through
:class:`KernelChooser` what its default is, how to measure, and which part of the machine's
file (``kernels-<machine key>.json``, :func:`runtime.kernels.machine.kernel_file`) holds its
choice; :func:`load_or_measure` does the rest the same way for both. ``ATTNCHAT_KERNELS=default``
skips measuring (the defaults); ``ATTNCHAT_KERNELS=measure`` measures again and replaces the
kept choice (a choice timed while other programs loaded the CPU can be off).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Protocol, TypeVar

from runtime.kernels import machine

log = logging.getLogger(__name__)

C = TypeVar("C")


class KernelChooser(Protocol[C]):
    """What :func:`load_or_measure` asks of one kind of weights."""

    #: Names the choice in the log ("the kernel choice").
    what: str
    #: Whether to measure at all (False: the defaults, e.g. block kernels off the CPU).
    measurable: bool
    #: On a busy machine: True, run the defaults unmeasured (``ATTNCHAT_KERNELS=measure``
    #: still measures and keeps); False, measure, use the choice, do not keep it.
    busy_runs_defaults: bool

    def default(self) -> C:
        """The choice without a measurement."""

    def measure(self) -> C:
        """Time the candidates now."""

    def from_kept(self, kept: dict) -> C | None:
        """The choice the file's content ``kept`` holds, None when it holds none that fits
        (it may raise KeyError, TypeError, ValueError on a malformed file)."""

    def keep(self, kept: dict, choice: C) -> dict:
        """The file's new content with ``choice`` in its part (``kept``: the content read)."""


def load_or_measure(folder: Path | None, chooser: KernelChooser[C]) -> C:
    """The choice kept in ``folder`` for this machine, else ``chooser.measure()`` (kept there for
    next time unless the machine was busy). ``folder`` None: measured, not kept."""
    mode = os.environ.get("ATTNCHAT_KERNELS", "")
    if mode == "default" or not chooser.measurable:
        return chooser.default()
    path = machine.kernel_file(folder)
    kept: dict = {}
    if path is not None and path.exists():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            choice = chooser.from_kept(kept)
            if choice is not None and mode != "measure":
                return choice
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            kept = {} if not isinstance(kept, dict) else kept
    if chooser.busy_runs_defaults and mode != "measure" and machine.busy():
        # Other programs have the cores: timings taken now are noise (on the 2-vCPU Intel
        # Xeon at load 5-10, ggml's pass over the default model timed at 125-437 ms against
        # 30 quiet, and int4pack "won" with a 63 MB repack). A quieter load measures.
        log.info("%s not measured: load %.1f on %d CPUs; the defaults run", chooser.what,
                 machine.machine_load(), os.cpu_count() or 1)
        return chooser.default()
    choice = chooser.measure()
    if not chooser.busy_runs_defaults and machine.busy():
        # Other programs had the cores: the timings may be off by orders of magnitude
        # (oneDNN's GEMV timed at 45 ms instead of 0.2 on a 2-core AMD EPYC Zen 3 at load
        # 5). Used for this run, measured again next time.
        log.info("%s not kept: measured at load %.1f on %d CPUs", chooser.what, machine.machine_load(),
                 os.cpu_count() or 1)
        return choice
    if path is not None and path.parent.exists():
        machine.keep_json(path, chooser.keep(kept, choice), chooser.what)
    return choice


def machine_folder() -> Path | None:
    """Where choices of the machine's own, not of one model's, are kept: the cache folder
    (None when it cannot be made: then measured each process, not kept)."""
    from models import paths

    try:
        return paths.cache_dir()
    except OSError:
        return None


def best_time_us(fn: Callable[[], object], reps: int, *, warm_up: bool = False) -> float:
    """The fastest of ``reps`` calls of ``fn`` in microseconds of wall time (the fastest:
    other programs only ever slow a run down); ``warm_up``: one untimed call first (a
    kernel's lazily made form or prepacking, the first touch of its pages)."""
    if warm_up:
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6
