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
    "APP_NAME", "BUNDLED_MODELS_SUBDIR", "CACHE_DIR_ENV", "MODELS_DIR_ENV",
    "bundled_models_dir", "cache_dir", "log_dir", "models_dir",
]


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


def models_dir() -> Path:
    """The folder holding model files: ``$ATTNCHAT_MODELS_DIR`` or the user data folder.

    Raises:
        OSError: the folder does not exist and cannot be created.
    """
    path = _from_env(MODELS_DIR_ENV)
    if path is None:
        path = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False)) / "models"
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
    """The cache folder: ``$ATTNCHAT_CACHE_DIR`` or the user cache folder.

    Raises:
        OSError: the folder does not exist and cannot be created.
    """
    path = _from_env(CACHE_DIR_ENV)
    if path is None:
        path = Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))
    return _ensure(path)


def log_dir() -> Path:
    """The folder for log files (the platform's user log folder).

    Raises:
        OSError: the folder does not exist and cannot be created.
    """
    return _ensure(Path(platformdirs.user_log_dir(APP_NAME, appauthor=False)))
