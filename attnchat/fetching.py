"""Getting the model a command names: ``--model SRC`` as a local path, fetched first when it is
a catalog id or a Hugging Face reference not downloaded yet, with a one-line progress on a
terminal. Shared by the command line, the server and the bench (which may not import each
other); imports only :mod:`models` (no torch).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import models
from models import UnknownModelError
from models.catalog import nearest_ids
from models.sizes import size_text

__all__ = ["PercentLine", "model_source", "unknown_model"]


class PercentLine:
    """Progress callback drawing ``fetching NAME: 42% (12.3 MiB of 29.4 MiB)`` on one terminal line."""

    def __init__(self, name: str, err: TextIO) -> None:
        self._name, self._err, self._last = name, err, -1

    def __call__(self, done_bytes: int, total_bytes: int) -> None:
        percent = 100 * done_bytes // total_bytes if total_bytes > 0 else 0
        if percent != self._last:
            self._last = percent
            self._err.write(f"\rfetching {self._name}: {percent:3d}% ({size_text(done_bytes)} of "
                            f"{size_text(total_bytes)})")
            self._err.flush()

    def finish(self) -> None:
        if self._last >= 0:
            self._err.write("\n")
            self._err.flush()


def model_source(src: str | None, err: TextIO | None = None) -> str | None:
    """What ``--model SRC`` names, as a local path: an existing file or folder as given; a catalog
    id or a Hub reference (``hf.co/OWNER/REPO:QUANT``) installed, or fetched first with
    progress on a terminal. None stays None (the default model, the loader's own choice), and
    anything else is returned as given (a missing path: the loader says so).

    Raises:
        models.FetchError: none of those, or the fetch failed (one line).
    """
    if src is None or Path(src).expanduser().exists():
        return src
    if not models.hub.is_hub_ref(src):
        try:
            models.get(src)
        except UnknownModelError:
            if _looks_like_a_path(src):
                return src  # a path that is not there: the loader's own message says so
            raise models.FetchError(unknown_model(src)) from None
    err = err or sys.stderr
    line = PercentLine(src, err) if err.isatty() else None
    try:
        return str(models.resolve(src, progress=line))
    finally:
        if line is not None:
            line.finish()


def _looks_like_a_path(src: str) -> bool:
    """A name with a folder in it or a model file's suffix: a path, not a misspelt catalog id."""
    return "/" in src or "\\" in src or src.startswith(("~", ".")) or \
        Path(src).suffix.lower() in (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def unknown_model(src: str) -> str:
    """One line for a ``--model`` that is neither a file, a folder nor a catalog id: the nearest
    catalog id when one is close (a typo is likelier than a missing file), and where to look."""
    near = nearest_ids(src)
    guess = f"did you mean {' or '.join(near)}? " if near else ""
    return (f"{src} is not a file, a model folder or a catalog id; {guess}`attnchat models list` shows the "
            "catalog's ids (or give a .gguf file, a model folder or hf.co/OWNER/REPO:QUANT)")
