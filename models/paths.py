"""Where attnchat keeps its files: models, caches and logs.

Every function here computes its answer when called (nothing happens at import
time) and creates the folder on demand.  Environment variables override the
platform defaults so that tests, CI and portable installs can redirect them:

- ``ATTNCHAT_MODELS_DIR``: the model folder (default: the user data folder,
  e.g. ``~/.local/share/attnchat/models`` on Linux).
- ``ATTNCHAT_CACHE_DIR``: the cache folder (default: ``~/.cache/attnchat``).

A frozen app (the PyInstaller bundle built by ``packaging/``) also carries a
read-only folder of models, :func:`bundled_models_dir`, so its first run needs
no network.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import platformdirs

APP_NAME = "attnchat"
MODELS_DIR_ENV = "ATTNCHAT_MODELS_DIR"
CACHE_DIR_ENV = "ATTNCHAT_CACHE_DIR"
BUNDLED_MODELS_SUBDIR = "bundled_models"
"""The models folder's name inside a frozen app's bundle (``packaging/attnchat.spec`` puts it there)."""

__all__ = [
    "APP_NAME", "BUNDLED_MODELS_SUBDIR", "CACHE_DIR_ENV", "MODELS_DIR_ENV", "UnsafeNameError",
    "bundled_models_dir", "cache_dir", "check_file_name", "inside", "log_dir", "models_dir", "private_dir",
    "private_file",
]

#: Modes of what holds the user's words (conversations, logs): theirs alone. On systems
#: where home folders are open to others (Debian's default), 0644 files in a 0755 folder
#: would let every local user read every conversation.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class UnsafeNameError(ValueError):
    """A name from outside (a Hub listing, a file's own keys) is not a plain file name, or
    would lead out of the folder it was meant for; ``str()`` is one line."""


#: Characters no file name of ours holds: separators (both systems'), NUL, other controls.
_UNSAFE_CHARS = frozenset("/\\\0") | frozenset(map(chr, range(32))) | {chr(127)}


def check_file_name(name: str, what: str = "name") -> str:
    """``name`` itself when it is one plain file name: not empty, not ``.`` or ``..``, no
    separator (``/``, ``\\``), no NUL or other control character, no drive (``C:``), no
    longer than 255 bytes in UTF-8 (the usual limit of a file system). ``what`` says whose
    name it is, for the message.

    Raises:
        UnsafeNameError: it is not (one line, the name quoted with ``repr``).
    """
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in _UNSAFE_CHARS for c in name) \
            or (len(name) >= 2 and name[1] == ":" and name[0].isalpha()) or len(name.encode("utf-8", "replace")) > 255:
        raise UnsafeNameError(f"{what} {name!r} is not a plain file name")
    return name


def inside(folder: Path, *names: str, what: str = "name") -> Path:
    """``folder / names[0] / names[1] ...`` after checking each with :func:`check_file_name`
    and the whole, links resolved, with :func:`os.path.commonpath` against ``folder``
    resolved: the one path check for every name that comes from outside.

    Raises:
        UnsafeNameError: a name is not a plain file name, or the path leads out of ``folder``
            (through a link on the way).
    """
    for name in names:
        check_file_name(name, what)
    target = Path(folder).joinpath(*names)
    base = os.path.realpath(folder)
    if os.path.commonpath([base, os.path.realpath(target)]) != base:
        raise UnsafeNameError(f"{what} {'/'.join(names)!r} leads out of {folder}")
    return target


def _from_env(name: str) -> Path | None:
    """The path in environment variable ``name``, or None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else None


def _ensure(path: Path) -> Path:
    """Create ``path`` (and its parents) if missing and return it.

    Raises:
        OSError: the folder cannot be created (permissions, a file in the way).
    """
    path.mkdir(parents=True, exist_ok=True)
    return path


def _restrict(path: Path, mode: int) -> None:
    """chmod ``path`` to ``mode`` if it has other bits (a no-op on Windows, where chmod
    only sets read-only, and for a path that is not ours to change)."""
    try:
        if os.name == "posix" and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)
    except (FileNotFoundError, PermissionError):
        pass


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if missing; make it :data:`PRIVATE_DIR_MODE`, also
    when it already existed with a wider mode (repaired on every start). Returns ``path``.

    Raises:
        OSError: the folder cannot be created.
    """
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    _restrict(path, PRIVATE_DIR_MODE)
    return path


def private_file(path: Path, *, create: bool = True) -> Path:
    """Make ``path`` :data:`PRIVATE_FILE_MODE`: created empty with that mode if missing
    (and ``create``), so it is never readable by others, not even for a moment;
    repaired if it exists with a wider mode. Returns ``path``.

    Raises:
        OSError: the file cannot be created.
    """
    if create:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), PRIVATE_FILE_MODE))
    _restrict(path, PRIVATE_FILE_MODE)
    return path


def models_dir() -> Path:
    """The folder holding model files: ``$ATTNCHAT_MODELS_DIR`` or the user data folder.

    Raises:
        OSError: the folder does not exist and cannot be created.
    """
    path = _from_env(MODELS_DIR_ENV)
    if path is None:
        # The user data folder also holds the conversations: private when made here.
        path = private_dir(Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))) / "models"
    return _ensure(path)


def bundled_models_dir() -> Path | None:
    """The read-only models folder shipped inside a frozen app, or None.

    Only a PyInstaller bundle has one (``sys.frozen`` set, the folder under
    ``sys._MEIPASS``); it is never created or written. Not named ``models``,
    which would shadow this package inside the bundle.
    """
    base = getattr(sys, "_MEIPASS", None) if getattr(sys, "frozen", False) else None
    if not base:
        return None
    path = Path(base) / BUNDLED_MODELS_SUBDIR
    return path if path.is_dir() else None


def cache_dir() -> Path:
    """The cache folder: ``$ATTNCHAT_CACHE_DIR`` or the user cache folder; private (0700,
    repaired when wider): it keeps a model's converted tokenizer and chat template, which
    say which models the user runs.

    Raises:
        OSError: the folder does not exist and cannot be created.
    """
    path = _from_env(CACHE_DIR_ENV)
    if path is None:
        path = Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
    return private_dir(path)


def log_dir() -> Path:
    """The folder for log files (the platform's user log folder), private (0700).

    Raises:
        OSError: the folder does not exist and cannot be created.
    """
    return private_dir(Path(platformdirs.user_log_dir(APP_NAME, appauthor=False)))
