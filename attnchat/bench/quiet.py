"""Whether a benchmark run was taken on a quiet machine.

A speed figure counts only from a quiet machine: on 2 cores, llama.cpp's threads and ours
wait on each other's spin barriers when another process takes a core, and a busy run's
ratio says more about the other process than about either engine. The bench reads the
1-minute load average (``os.getloadavg``, what ``uptime`` prints) before and after each
engine's run and marks a run noisy when either passed :data:`QUIET_LOAD`; ratios are not
claimed from noisy runs.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

__all__ = ["QUIET_LOAD", "load_average", "mark", "describe", "busy_processes"]

#: The 1-minute load average above which a run is noisy (the project's rule for speed figures).
QUIET_LOAD = 1.5


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none, e.g. Windows)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def mark(run: dict, before: float | None, after: float | None) -> dict:
    """Record ``before``/``after`` in ``run`` (``load_before``, ``load_after``) and ``noisy``:
    True when either passed :data:`QUIET_LOAD`, None when the load is unknown. Returns ``run``."""
    run["load_before"], run["load_after"] = before, after
    known = [x for x in (before, after) if x is not None]
    run["noisy"] = None if not known else any(x > QUIET_LOAD for x in known)
    return run


def describe(run: dict) -> str:
    """``"load 0.12 -> 0.85"`` (and ``", noisy"``) for a run marked by :func:`mark`."""
    b, a = run.get("load_before"), run.get("load_after")
    if b is None and a is None:
        return "load unknown"
    fmt = lambda x: "?" if x is None else f"{x:.2f}"  # noqa: E731
    return f"load {fmt(b)} -> {fmt(a)}" + (", noisy" if run.get("noisy") else "")


#: A process that keeps one core busy (--busy), and dies with the bench: on Linux its parent's
#: death sends it SIGKILL (prctl PR_SET_PDEATHSIG), so a bench killed by a timeout leaves no
#: spinning orphan (one was seen spinning for 20 minutes after a timed-out test).
_BUSY = ("try:\n import ctypes, signal\n ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))\n"
         "except Exception:\n pass\nwhile True: pass")


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes (``subprocess.Popen``) that keep a core busy each while the block runs
    (``--busy``), killed and reaped when it ends, however it ends."""
    hogs = [subprocess.Popen([sys.executable, "-I", "-c", _BUSY]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
            h.wait()
