"""Starting QThreads so that none is forgotten: tests (tests/desktop/conftest.py) fail any test
that leaves one running.

Imports Qt only (no runtime, no torch, no widgets).
"""
from __future__ import annotations

import weakref
from typing import Callable

from PySide6.QtCore import QObject, QThread

__all__ = ["live_threads", "start_thread"]

_THREADS: "weakref.WeakSet[QThread]" = weakref.WeakSet()


def start_thread(name: str, obj: QObject | None = None, run: Callable | None = None) -> QThread:
    """A started QThread, remembered so tests can check none is left running.

    ``obj`` (if given) is moved onto it first, and ``run`` connected to its ``started``.
    """
    thread = QThread()
    thread.setObjectName(name)
    if obj is not None:
        obj.moveToThread(thread)
    if run is not None:
        thread.started.connect(run)
    _THREADS.add(thread)
    thread.start()
    return thread


def live_threads() -> list[QThread]:
    """Threads made by :func:`start_thread` that are still running."""
    out = []
    for t in list(_THREADS):
        try:
            if t.isRunning():
                out.append(t)
        except RuntimeError:  # the C++ object is gone: not running
            pass
    return out
