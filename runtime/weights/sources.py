"""Where a model comes from, and what is refused before anything opens it: missing, empty
or non-GGUF files here; GGUF metadata past the limits, pickled checkpoints and folders
whose JSON names custom code by :mod:`models.safety` (every "may this run here" rule, in
one place), its refusals raised as runtime's errors.

Must not import Qt. Never ``trust_remote_code``; never unpickle.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from models import safety
from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError, UnsupportedModelError

PICKLE_SUFFIXES = tuple(sorted(safety.PICKLE_SUFFIXES))


GGUF_MAGIC = b"GGUF"


# ---- sources ---------------------------------------------------------------------------
def check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist; check the path or run `attnchat models list`")
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device: reading it could wait or never end
        raise ModelLoadError(f"{path} is not a regular file (a device or a pipe); give a .gguf file or a model folder")
    size = st.st_size
    if size == 0:
        raise ModelLoadError(f"model file {path} is empty; download it again")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF header); give a .gguf file or a model folder")


def check_gguf_metadata(path: Path) -> None:
    """Refuse a GGUF whose metadata passes :mod:`models.safety.gguf_scan`'s limits, before a
    reader that builds it in memory opens it (bounded memory; ~0.05 s of CPU for the default model).
    A file that passed every check and has not changed since is not walked again
    (:mod:`runtime.weights.checked`)."""
    from runtime.weights import checked

    if checked.passed(path):
        return
    before = checked.identity(path)
    try:
        safety.check_gguf(path)
        checked.header_passed(path, before)
    except safety.Refused as e:
        raise ModelLoadError(str(e)) from None
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e.strerror})") from None


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
