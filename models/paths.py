"""Where attnchat keeps its files: models, caches and logs.

Every function here computes its answer when called (nothing happens at import
time) and creates the folder on demand.  Environment variables override the
platform defaults so that tests, CI and portable installs can redirect them:

- ``ATTNCHAT_MODELS_DIR``: the model folder (default: the user data folder,
  e.g. ``~/.local/share/attnchat/models`` on Linux).
- ``ATTNCHAT_CACHE_DIR``: the cache folder (default: ``~/.cache/attnchat``).
"""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "attnchat"
MODELS_DIR_ENV = "ATTNCHAT_MODELS_DIR"
CACHE_DIR_ENV = "ATTNCHAT_CACHE_DIR"

__all__ = ["APP_NAME", "CACHE_DIR_ENV", "MODELS_DIR_ENV", "cache_dir", "log_dir", "models_dir"]


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
