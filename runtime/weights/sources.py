"""Where a model comes from, and what is refused before anything opens it: missing, empty
or non-GGUF files, GGUF metadata past our limits, pickled checkpoints, and folders whose
JSON names custom code (``auto_map``).

Must not import Qt. Never ``trust_remote_code``; never unpickle.
"""
from __future__ import annotations

import os
from pathlib import Path

from runtime.config.model import ModelConfig
from runtime.errors import ModelLoadError, UnsupportedModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


GGUF_MAGIC = b"GGUF"


# ---- sources ---------------------------------------------------------------------------
def check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist; check the path or run `attnchat models list`")
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(f"model file {path} is empty; download it again")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF header); give a .gguf file or a model folder")


def check_gguf_metadata(path: Path) -> None:
    """Refuse a GGUF whose metadata passes :mod:`runtime.weights.gguf_header`'s limits, before a
    reader that builds it in memory opens it (bounded memory; ~0.05 s of CPU for the default model)."""
    from runtime.weights.gguf_header import GGUFHeaderError, scan_header

    try:
        scan_header(path)
    except GGUFHeaderError as e:
        raise ModelLoadError(f"{path.name} was refused: its header could not be read within attnchat's limits "
                             f"({e}); download it again if it was cut short, or use a model whose metadata "
                             "stays within the sizes real models use") from None
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e.strerror})") from None


def _names_custom_code(file: Path, chunk: int = 1 << 20) -> bool:
    """True when ``file`` holds the key ``"auto_map"`` (read in chunks: bounded memory)."""
    needle, tail = b'"auto_map"', b""
    with file.open("rb") as f:
        while block := f.read(chunk):
            if needle in tail + block:
                return True
            tail = block[-(len(needle) - 1):]
    return False


def refuse_custom_code(path: Path) -> None:
    """Refuse a model folder any of whose JSON files names custom code (``auto_map``).

    ``auto_map`` in config.json, tokenizer_config.json, processor or generation
    configs points transformers at Python files shipped in the folder. attnchat passes
    ``trust_remote_code=False`` everywhere, and refuses such a folder outright besides,
    so no version of transformers ever asks whether to run that code.

    Raises:
        UnsupportedModelError: an ``auto_map`` in any ``*.json`` of the folder or its
            subfolders (links to folders are not followed).
    """
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            file = Path(root) / name
            if not name.lower().endswith(".json"):
                continue
            try:
                found = _names_custom_code(file)
            except OSError:
                continue
            if found:
                raise UnsupportedModelError(
                    f"{path.name} needs custom code from its authors ('auto_map' in {file.relative_to(path)}: "
                    "trust_remote_code), which attnchat never runs; pick a model with a standard architecture")


def refuse_pickle(path: Path) -> None:
    raise ModelLoadError(
        f"{path.name} is a pickled PyTorch checkpoint, which can run arbitrary code when opened; "
        f"attnchat never unpickles: convert it to safetensors or GGUF"
    )


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
