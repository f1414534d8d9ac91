"""Where the app's save dialogs start: the user's documents folder (then the folder of the
last export in this run), never the current directory (a source checkout when started from one).

Imports Qt only.
"""
from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QStandardPaths
from PySide6.QtWidgets import QFileDialog, QWidget

__all__ = ["documents_dir", "save_file_name"]

_last_dir: str | None = None   # the folder of the last file saved through save_file_name (this run)


def documents_dir() -> str:
    """The user's documents folder (``~/Documents`` or the XDG one); the home folder when there is none."""
    found = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return found if found and os.path.isdir(found) else str(Path.home())


def save_file_name(parent: QWidget | None, title: str, name: str, kinds: str) -> str:
    """A save dialog for a file called ``name`` in :func:`documents_dir` (or the last folder saved
    to); the chosen path, or "" when cancelled. ``kinds``: Qt's filter, e.g. ``"Markdown (*.md)"``."""
    global _last_dir
    start = os.path.join(_last_dir or documents_dir(), name)
    path, _ = QFileDialog.getSaveFileName(parent, title, start, kinds)
    if path:
        _last_dir = os.path.dirname(path)
    return path
