"""A guard against a PySide6 reference-count bug that crashes Python 3.11.

PySide6 6.12.0's wheels (abi3) return ``None`` from every C++ ``void`` method
without taking a reference to it. From Python 3.12 on ``None`` is immortal and this
is harmless; on Python 3.11 each call steals one reference, and after a few
thousand calls (``widget.update()``, ``painter.setPen()``, ``processEvents()``...)
the interpreter aborts with "Fatal Python error: none_dealloc". PySide6 6.11.3 does
not have the bug. Reproduce with::

    for _ in range(10_000): QWidget().update()   # aborts on 3.11 + PySide6 6.12.0

:func:`guard_none_refcount` probes for the bug and, only when it is present, does
what Python 3.12 does: it makes ``None`` immortal in practice by adding 2**40 to its
reference count (so it can never reach zero). Call it once, early, before other
threads run. The real fix is a PySide6 without the bug (or Python >= 3.12).
Must not import torch or runtime.
"""
from __future__ import annotations

import ctypes
import logging
import sys

__all__ = ["guard_none_refcount", "steals_none"]

log = logging.getLogger(__name__)
_BUMP = 1 << 40
_guarded = False


def steals_none(calls: int = 200) -> bool:
    """True when a void PySide6 call drops a reference to ``None`` (the bug above)."""
    from PySide6.QtCore import QObject

    obj = QObject()
    before = sys.getrefcount(None)
    for _ in range(calls):
        obj.setObjectName("probe")
    return before - sys.getrefcount(None) >= calls // 2


def guard_none_refcount() -> bool:
    """Apply the guard if needed (once); True when it was applied."""
    global _guarded
    if _guarded or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return _guarded
    if not steals_none():
        return False
    # ob_refcnt is the first Py_ssize_t of every object in CPython 3.11 release builds.
    ctypes.c_ssize_t.from_address(id(None)).value += _BUMP
    _guarded = True
    import PySide6

    log.warning("PySide6 %s drops references to None on Python %d.%d; None made immortal "
                "to avoid a crash (use PySide6 6.11.3, or Python 3.12+)", PySide6.__version__, *sys.version_info[:2])
    return True
