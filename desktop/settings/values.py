"""The app's settings: one class over QSettings with one table of defaults.

Unchanged writes are skipped; real changes emit :attr:`Settings.changed`. Tests
(and ``--self-test`` / ``--screenshot``) pass an INI file path so nothing touches
the user's own settings. The file holds the system prompt and the model's path: it is
0600 in a 0700 folder, created so and repaired at each start (QSettings rewrites it
through a new file that keeps the old one's mode). Must not import torch or runtime.
"""
from __future__ import annotations

import hashlib

import logging
import os
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QObject, QSettings, Signal

from desktop.settings.presets import DEFAULT_PRESET, PRESETS
from models.paths import private_dir, private_file

log = logging.getLogger(__name__)

__all__ = ["DEFAULTS", "GENERATION_KEYS", "PER_MODEL_KEYS", "Settings", "model_group"]

#: Every key the app reads, with its default (which also fixes the value's type).
DEFAULTS: dict[str, Any] = {
    "window/geometry": QByteArray(),
    "window/state": QByteArray(),
    "window/splitter": QByteArray(),
    "window/panel_widths": "",   # JSON: each panel's width as the user set it (px; desktop.main_window.panel_width)
    "window/drafts": "",         # JSON: conversation id -> the text typed and not sent at the last Quit
    "last_conversation": 0,
    "model/source": "",          # "" = the default model
    "model/device": "auto",
    "models/recommendation_offered": False,   # a better first model was recommended once (desktop.model_switcher)
    "remote/base_url": "",       # the last server connected to (its key: desktop.remote.secrets, never here)
    "server/port": 0,            # Server > Serve: the loopback port, chosen free once (0: not yet)
    "server/require_key": False,  # Server > Serve: clients must send the API key (kept in the keyring)
    "generation/system_prompt": "",
    "generation/max_new_tokens": 512,
    # Sampling (temperature, top-k/p, min-p, repetition penalty): the balanced preset, unless
    # the model's file gives its own and model_sampling is on (desktop.main_window.replies).
    **PRESETS[DEFAULT_PRESET],
    "generation/model_sampling": True,
    "generation/context": 0,      # 0 = the model's maximum
    # The settings dialog (desktop.settings.dialog) edits these and the ones above.
    "model/weight_dtype": "auto",              # auto = per device (runtime.device.default_dtype)
    "model/attention_backend": "fast",         # or "reference"
    "model/reproducible": "off",               # or "on": runtime.load_model(reproducible=True), CPU only
    "generation/seed": -1,                     # -1 = a fresh random seed per reply
    "generation/cache_dtype": "auto",          # auto = the model's default (runtime.default_cache_dtype)
    "generation/cache_limit_mib": 0.0,         # 0 = no limit
    "generation/overflow": "truncate-middle",  # stop | truncate-middle | rolling
    "generation/sink_tokens": 4,               # tokens the rolling policy always keeps
    "generation/cache_policy": "none",         # none | sinks-window | h2o | snapkv | tova | key-norm
    "generation/cache_budget": 1024.0,         # what a cache policy keeps, in cache_budget_unit
    "generation/cache_budget_unit": "tokens",  # tokens | MiB
}

#: The ``generation/*`` keys a request carries to the worker, by their short names.
GENERATION_KEYS = (
    "system_prompt", "max_new_tokens", "temperature", "context", "top_k", "top_p", "min_p",
    "repetition_penalty", "seed", "cache_dtype", "cache_limit_mib", "overflow", "sink_tokens",
    "cache_policy", "cache_budget", "cache_budget_unit", "model_sampling",
)


def _make_private(file: Path) -> None:
    """``file``'s folder 0700 and ``file`` 0600 (created empty if missing: QSettings keeps
    an existing file's mode when it writes). POSIX only; a failure is logged, not raised."""
    if os.name != "posix" or not file.is_absolute():
        return
    try:
        private_dir(file.parent)
        private_file(file)
    except OSError:
        log.warning("could not make the settings file %r private", str(file), exc_info=True)


#: The settings kept for each model file (LM Studio keeps a configuration per model): while a
#: model is loaded (:meth:`Settings.use_model`) these are read from and written to its own group,
#: and a model never set up reads the general values.
PER_MODEL_KEYS = (
    "generation/context", "generation/system_prompt", "generation/temperature", "generation/top_k",
    "generation/top_p", "generation/min_p", "generation/repetition_penalty", "generation/model_sampling",
    "generation/max_new_tokens", "generation/cache_policy", "generation/cache_budget",
    "generation/cache_budget_unit",
)


def model_group(model: str) -> str:
    """The settings group of a model file (``model``: its path or a server's source): a digest,
    so no path becomes a key."""
    return "per_model/" + hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class Settings(QObject):
    """Typed access to QSettings with defaults.

    Args:
        path: an INI file to use instead of the platform's settings store.
    """

    changed = Signal(str, object)  # key, new value

    def __init__(self, path: str | Path | None = None, parent: QObject | None = None):
        super().__init__(parent)
        if path is None:
            self._qs = QSettings("attnchat", "attnchat")
        else:
            self._qs = QSettings(str(path), QSettings.Format.IniFormat)
        _make_private(Path(self._qs.fileName()))
        self.model = ""   # the model file whose own settings apply ("" = none: the general ones)

    def use_model(self, model: str) -> None:
        """Read and write :data:`PER_MODEL_KEYS` for ``model`` from now on (its path; "" for none);
        emits :attr:`changed` for each whose value differs from the last model's."""
        before = {k: self.get(k) for k in PER_MODEL_KEYS}
        self.model = str(model or "")
        if self.model:
            self._qs.setValue(f"{model_group(self.model)}/path", self.model)   # which file the group is for
        for k in PER_MODEL_KEYS:
            now = self.get(k)
            if now != before[k]:
                self.changed.emit(k, now)

    def _where(self, key: str, *, writing: bool = False) -> str:
        """The QSettings key ``key`` is read from (or written to): the model's own for
        :data:`PER_MODEL_KEYS` while a model is set (reading: once it has a value there)."""
        if not self.model or key not in PER_MODEL_KEYS:
            return key
        own = f"{model_group(self.model)}/{key}"
        return own if writing or self._qs.contains(own) else key

    def get(self, key: str) -> Any:
        """The value of ``key`` (its default when unset), converted to the default's type; for
        :data:`PER_MODEL_KEYS`, the current model's own where it has one.

        Raises:
            KeyError: ``key`` is not in :data:`DEFAULTS`.
        """
        default = DEFAULTS[key]
        value = self._qs.value(self._where(key), default)
        if value is None:
            return default
        try:
            if isinstance(default, bool):
                return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            if isinstance(default, (int, float, str)):
                return type(default)(value)
            if isinstance(default, QByteArray) and not isinstance(value, QByteArray):
                return default
        except (TypeError, ValueError):
            return default
        return value

    def set(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key``; a write that changes nothing is skipped."""
        if key not in DEFAULTS:
            raise KeyError(key)
        if self.get(key) == value:
            return
        self._qs.setValue(self._where(key, writing=True), value)
        self.changed.emit(key, value)

    def stored(self, key: str) -> Any:
        """What the settings file holds for ``key``, unconverted (None when unset): for messages about bad values."""
        return self._qs.value(key)

    def readable(self, key: str) -> bool:
        """False when ``key`` holds a value its default's type cannot be read from (say ``context=abc``);
        :meth:`get` then gives the default."""
        default, value = DEFAULTS[key], self._qs.value(key)
        if value is None or isinstance(default, bool) or not isinstance(default, (int, float)):
            return True
        try:
            type(default)(value)
        except (TypeError, ValueError):
            return False
        return True

    def reset(self, key: str) -> None:
        """Forget ``key``'s stored value, so it reads as its default (emits :attr:`changed` if that changes it)."""
        before = self.get(key)
        self._qs.remove(key)
        if self._where(key) != key:
            self._qs.remove(self._where(key))
        if before != DEFAULTS[key]:
            self.changed.emit(key, DEFAULTS[key])

    def generation_values(self) -> dict[str, Any]:
        """The ``generation/*`` settings as a request's plain dict (short names, see :data:`GENERATION_KEYS`)."""
        return {k: self.get(f"generation/{k}") for k in GENERATION_KEYS}

    def sync(self) -> None:
        self._qs.sync()

    @property
    def file_name(self) -> str:
        return self._qs.fileName()
