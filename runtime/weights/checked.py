"""What is checked of a GGUF before any reader opens it (:func:`check_gguf_file`,
:func:`check_gguf_metadata`), and the files that passed every check on their contents,
remembered by the file's identity, so that loading the same unchanged file again skips the
walks that read it.

Must not import Qt. Two checks read a GGUF's contents before anything else uses them: the
header walk (:func:`models.safety.check_gguf`: counts and sizes within limits, 0.8 s of
Python over Gemma 3's 262,144-entry vocabulary) and the scan of every block's scales for
NaN or infinity (:func:`runtime.weights.validate.check_gguf`: the whole file read again).
Their verdict depends only on the file's bytes and on the checks themselves. A file counts as
unchanged when its device, inode, size, modification time and status-change time are the
same: the status-change time (``st_ctime_ns``) is set by the kernel on every write, rename
or truncation and cannot be set back by ``touch`` or ``os.utime``. :data:`CHECKS` names the
version of the checks; a change to them bumps it and every file is checked again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path

from models import safety
from runtime.errors import ModelLoadError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Refuse what is not a GGUF file before anything reads it: a missing path, a FIFO or a
    device (reading it could wait or never end), an empty file, no ``GGUF`` magic.

    Raises:
        ModelLoadError: one line saying which, and what to do.
    """
    if not path.exists():
        raise ModelLoadError(f"model file {path} does not exist; check the path or run `attnchat models list`")
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"{path} is not a regular file (a device or a pipe); give a .gguf file or a model folder")
    if st.st_size == 0:
        raise ModelLoadError(f"model file {path} is empty; download it again")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF header); give a .gguf file or a model folder")


def check_gguf_metadata(path: Path) -> None:
    """Refuse a GGUF whose metadata passes :mod:`models.safety.gguf_scan`'s limits, before a
    reader that builds it in memory opens it (bounded memory; ~0.05 s of CPU for the default model).
    A file that passed every check and has not changed since is not walked again (:func:`passed`).

    Raises:
        ModelLoadError: past a limit (the refusal's own line), or unreadable.
    """
    if passed(path):
        return
    before = identity(path)
    try:
        safety.check_gguf(path)
        header_passed(path, before)
    except safety.Refused as e:
        raise ModelLoadError(str(e)) from None
    except OSError as e:
        raise ModelLoadError(f"{path} could not be read ({e.strerror})") from None

#: The version of the checks a remembered verdict was reached by.
CHECKS = "header-walk-1,scale-scan-1"


def _identity(path: Path) -> dict | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"checks": CHECKS, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _marker(path: Path) -> Path | None:
    from models import paths

    try:
        key = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:16]
        return paths.cache_dir() / "checked" / f"{key}.json"
    except (OSError, RuntimeError):
        return None


def beside(path: Path, kind: str) -> Path | None:
    """A file of ``kind`` kept beside ``path``'s verdict (``checked/<key>.<kind>.json``), or None."""
    marker = _marker(path)
    return None if marker is None else marker.with_name(f"{marker.stem}.{kind}.json")


#: Files whose header walk passed in this process, with their identity then.
_HEADERS: dict[str, dict] = {}


def header_passed(path: Path, identity: dict | None) -> None:
    """Note that the header walk passed on ``path`` as it was at ``identity`` (taken before it)."""
    if identity is not None:
        _HEADERS[str(Path(path).resolve())] = identity


def identity(path: Path) -> dict | None:
    """The file's identity now (None: it cannot be read)."""
    return _identity(path)


def passed(path: Path) -> bool:
    """Whether ``path`` passed every check as the file it is now (False when unknown)."""
    now, marker = _identity(path), _marker(path)
    if marker is None or now is None:
        return False
    try:
        return json.loads(marker.read_text(encoding="utf-8")) == now
    except (OSError, ValueError):
        return False


def remember(path: Path) -> None:
    """Note that ``path`` passed the scale scan too (atomic; a failure only costs the next load
    time). Kept only when its header walk passed on the same file, unchanged since."""
    marker, now = _marker(path), _identity(path)
    if marker is None or now is None or _HEADERS.get(str(Path(path).resolve())) != now:
        return
    tmp = marker.with_name(f"{marker.name}.tmp{os.getpid()}")
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(now), encoding="utf-8")
        os.replace(tmp, marker)
    except OSError:
        log.warning("could not remember that %s passed its checks", path, exc_info=True)
        tmp.unlink(missing_ok=True)
