"""Where a model comes from, and what is refused before anything opens it: pickled
checkpoints and folders whose JSON names custom code by :mod:`models.safety` (every "may
this run here" rule, in one place), its refusals raised as runtime's errors; a GGUF's own
checks before a reader opens it are :mod:`runtime.weights.checked`'s.

Must not import Qt. Never ``trust_remote_code``; never unpickle.
"""
from __future__ import annotations

import os
from pathlib import Path

from models import safety
from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError, UnsupportedModelError

PICKLE_SUFFIXES = tuple(sorted(safety.PICKLE_SUFFIXES))


def refuse_custom_code(path: Path) -> None:
    """Refuse a model folder any of whose JSON files names custom code
    (:func:`models.safety.check_folder`: ``auto_map`` in any spelling at any depth, or a
    string naming one of the folder's ``*.py`` files).

    Raises:
        UnsupportedModelError: the folder names custom code.
        ModelLoadError: a JSON file that cannot be checked (too big, not JSON).
    """
    try:
        safety.check_folder(path)
    except safety.Refused as e:
        raise (UnsupportedModelError if e.kind == "custom_code" else ModelLoadError)(str(e)) from None


def refuse_pickle(path: Path) -> None:
    try:
        safety.refuse_pickle(path)
    except safety.Refused as e:
        raise ModelLoadError(str(e)) from None


def one_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_config(path: Path, hf_config) -> ModelConfig:
    """:meth:`ModelConfig.from_hf`, with the file or folder named in its error."""
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path.name}: {e}") from None


def resolve_source(source: str | os.PathLike | None) -> Path:
    """The path of a model source (the default model, fetched if missing, for ``None``);
    pickled checkpoints are refused here, before anything opens them."""
    if source is None:
        from models import fetch

        path = fetch.ensure_default()
    else:
        path = Path(source).expanduser()
    if path.suffix.lower() in PICKLE_SUFFIXES:
        refuse_pickle(path)
    return path
