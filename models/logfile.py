"""The log file: where tracebacks of unexpected failures go, never the user's terminal or window.

Stdlib only (no torch, no Qt). :func:`to_file` sends the root logger to
``log_dir() / "attnchat.log"``; the command line and the desktop app both call it
first thing. It adds its own handler instead of calling ``logging.basicConfig``,
which does nothing once any handler is installed (an embedding program's, a test
runner's), and it is idempotent, so the app started from the command line logs
each record once.
"""
from __future__ import annotations

import logging
from pathlib import Path

from models import paths

__all__ = ["LOG_NAME", "log_file", "to_file"]

LOG_NAME = "attnchat.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s]: %(message)s"


def log_file() -> Path:
    """``log_dir() / "attnchat.log"`` (the folder is created).

    Raises:
        OSError: the log folder cannot be created.
    """
    return paths.log_dir() / LOG_NAME


def to_file(level: int = logging.INFO) -> Path | None:
    """Log ``level`` and above to the log file; returns its path, or None when it cannot be opened.

    Calling it again adds nothing. A log folder that cannot be written is not an error
    for the caller: the program runs on without a log file.
    """
    try:
        path = log_file()
    except OSError:
        return None
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.absolute():
            return path
    try:
        paths.private_file(path)  # 0600 before the first record: logs quote what users type
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    return path
