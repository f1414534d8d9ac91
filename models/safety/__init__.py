"""Every rule on whether a model file, a model folder, a chat template or a key file from
someone else may be used here, and what it may cost, in one place.

The rules (each raises :class:`Refused`, one line; the limits are in the modules named):

- **Pickles** (``.bin .pt .pth .ckpt .pkl .pickle``): never opened (unpickling runs code).
- **GGUF metadata** (:mod:`.gguf_scan`): a bounded walk of the header admits a vocabulary
  (tokens, scores, token types: one length, at most 300,000; merges), any other array of at
  most 4,096 items (65,536 in all), and arrays whose reading would cost a reader at most
  1 GiB; refused from the counts, before any reader builds the arrays.
- **Custom code** (:mod:`.custom_code`): a folder any of whose ``*.json`` files, at any
  depth, has the key ``auto_map`` in any JSON spelling, or a string naming one of the
  folder's ``*.py`` files; a folder holding anything but regular files and folders (a link
  to ``/dev/zero``, a FIFO) or a ``*.jinja`` template over 1 MiB.
- **Chat templates** (:mod:`.template`): rendered in a child process with bounded memory
  (256 MiB + 16 bytes per byte of the request), time (10 s) and output; templates of at
  most 1 MiB.
- **Shapes** (:mod:`.shape`): a GGUF's layers, heads, hidden size, context and vocabulary
  whole numbers of at least 1 and within limits far past any real model's, the query heads
  a multiple of the key/value heads; checked on a local file's metadata and a Hub file's
  header alike.
- **Key files** (:func:`check_key_file`): not readable by other users.

Who calls them: every model load and config read (``runtime.weights.sources``: chat,
serve, its tool probe, the desktop), every template render (``runtime.generate.chat_format``),
``attnchat models import`` (:func:`models.store.import_model`: refused, not copied), Hub
downloads (:func:`models.hub.download.download_file`: checked before the file enters the
model folder), ``attnchat serve --api-key-file``.

Stdlib only (the template sandbox's child imports jinja2); never imports torch or Qt.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .custom_code import CustomCodeError, find_custom_code
from .gguf_scan import GGUFHeaderError, HeaderStats, scan_header
from .refused import Refused
from .shape import check_metadata as check_shape
from .template import TemplateRefused, render_template

__all__ = [
    "GGUF_MAGIC", "PICKLE_SUFFIXES", "Refused", "TemplateRefused", "check_folder", "check_gguf", "check_key_file",
    "check_model", "check_shape", "is_pickle", "refuse_pickle", "render_template",
]

#: File name endings of pickled checkpoints: refused, never opened (unpickling runs code).
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
GGUF_MAGIC = b"GGUF"


def is_pickle(path: Path) -> bool:
    return Path(path).suffix.lower() in PICKLE_SUFFIXES


def refuse_pickle(path: Path) -> None:
    """Raises :class:`Refused` (kind ``"pickle"``) naming ``path``."""
    raise Refused(f"{Path(path).name} is a pickled PyTorch checkpoint, which can run arbitrary code when opened; "
                  "attnchat never unpickles: convert it to safetensors or GGUF", "pickle")


def check_gguf(path: Path, name: str | None = None) -> HeaderStats:
    """The GGUF header scan of ``path`` (:func:`.gguf_scan.scan_header`); returns its stats.
    ``name``: how messages name the file (default: its file name).

    Raises:
        Refused: kind ``"gguf"``: truncated, malformed or past a limit.
        OSError: the file cannot be read.
    """
    try:
        return scan_header(path)
    except GGUFHeaderError as e:
        raise Refused(f"{name or Path(path).name} was refused: its header could not be read within attnchat's limits "
                      f"({e}); download it again if it was cut short, or use a model whose metadata stays within "
                      "the sizes real models use", "gguf") from None


def check_folder(path: Path) -> None:
    """Refuse a model folder whose JSON names custom code (:mod:`.custom_code`).

    ``auto_map`` in config.json, tokenizer_config.json, processor or generation configs
    points transformers at Python files shipped in the folder. attnchat passes
    ``trust_remote_code=False`` everywhere, and refuses such a folder outright besides,
    so no version of transformers ever asks whether to run that code.

    Raises:
        Refused: kind ``"custom_code"`` (the file and what it names) or ``"json"`` (a JSON
            file too big to check, or not JSON).
    """
    path = Path(path)
    try:
        found = find_custom_code(path)
    except CustomCodeError as e:
        raise Refused(f"{path.name} was refused: {e}; re-export the model", "json") from None
    if found is not None:
        file, what = found
        where = f"{what} in {file}: trust_remote_code" if what == "'auto_map'" else f"{what}, named in {file}"
        raise Refused(f"{path.name} needs custom code from its authors ({where}), which attnchat never runs; "
                      "pick a model with a standard architecture", "custom_code")


def check_model(path: Path, name: str | None = None) -> None:
    """Every rule for a model source: a folder's custom code, a pickle, a GGUF's metadata.
    Files that are not GGUF are left to the caller's own message, except when ``name``
    is given (a download, named so in messages), which must be GGUF.

    Raises:
        Refused: see :func:`check_folder`, :func:`refuse_pickle`, :func:`check_gguf`.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        check_folder(path)
        return
    if is_pickle(path):
        refuse_pickle(path)
    with open(path, "rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            if name is None:
                return
            raise Refused(f"{name} is not a GGUF file (no GGUF header)", "gguf")
    check_gguf(path, name)


def check_key_file(path: str | os.PathLike[str]) -> str | None:
    """Whether the key file ``path`` may be read: a warning (one line) when users of its
    group may read it, None when only its owner may.

    Raises:
        Refused: kind ``"key_file"``: anyone may read it (``o+r``), or it is not a regular
            file (a FIFO could feed a key someone else writes).
        OSError: it cannot be examined.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"--api-key-file {str(path)!r} is not a regular file; keep the key in a file of its own",
                      "key_file")
    mode = stat.S_IMODE(st.st_mode)
    if os.name != "posix":
        return None
    if mode & stat.S_IROTH:
        raise Refused(f"--api-key-file {str(path)!r} is readable by every user of this machine (mode {mode:04o}); "
                      f"run `chmod 600 {path}` and start again", "key_file")
    if mode & stat.S_IRGRP:
        return (f"--api-key-file {str(path)!r} is readable by its group (mode {mode:04o}); "
                f"`chmod 600 {path}` keeps the key yours alone")
    return None
