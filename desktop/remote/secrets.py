"""API keys for remote engines: the system keyring when there is one, else memory only.

A key is never written to QSettings or to any file of ours. :class:`KeyStore` keeps
the keys of this session in memory and, when the ``keyring`` package finds a usable
backend (Secret Service on Linux, the macOS Keychain, the Windows Credential Locker:
anything but keyring's ``fail`` and ``null`` backends), in that keyring too, under the
service name ``attnchat`` with the server's base URL as the user name. Without one the
key lasts until the app quits, and the connect dialog says so.

Thread-safe: the connect dialog writes keys on the GUI thread and the engine worker
reads them on its own. Must not import torch, runtime or Qt.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["KeyStore", "SERVICE", "usable_backend"]

log = logging.getLogger(__name__)

#: The keyring service name the keys are stored under.
SERVICE = "attnchat"


def usable_backend() -> Any | None:
    """The system keyring's backend, or None when there is none that can store a key.

    keyring falls back to its ``fail`` backend (every call raises) when it finds no
    keyring service, e.g. on a headless Linux without a D-Bus session.
    """
    try:
        import keyring
        from keyring.backends import chainer, fail, null

        backend = keyring.get_keyring()
    except Exception:  # noqa: BLE001 - not installed, or a broken configuration: no keyring
        log.info("no usable keyring", exc_info=True)
        return None
    if isinstance(backend, (fail.Keyring, null.Keyring)):
        return None
    if isinstance(backend, chainer.ChainerBackend) and not backend.backends:
        return None
    return backend


def _backend_name(backend: Any) -> str:
    name = getattr(backend, "name", "") or type(backend).__name__
    return str(name).removeprefix("keyring.backends.")


class KeyStore:
    """API keys by server base URL.

    Args:
        backend: a keyring backend to use (tests pass an in-memory one); ``"system"``
            (the default) asks keyring for the system's; ``None`` keeps keys in memory only.
    """

    def __init__(self, backend: Any = "system"):
        self._backend = usable_backend() if backend == "system" else backend
        self._memory: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def persistent(self) -> bool:
        """True when keys go to a system keyring (and so outlive this session)."""
        return self._backend is not None

    def where(self) -> str:
        """Where a key is kept, in words for the connect dialog."""
        if self._backend is None:
            return ("No system keyring was found: the key is kept in memory until attnchat quits "
                    "and never written to disk.")
        return f"The key is kept in the system keyring ({_backend_name(self._backend)}), never in the settings file."

    @staticmethod
    def _name(base_url: str) -> str:
        return base_url.strip().rstrip("/")

    def get(self, base_url: str) -> str:
        """The key for ``base_url`` ("" when there is none)."""
        name = self._name(base_url)
        with self._lock:
            if name in self._memory:
                return self._memory[name]
            backend = self._backend
        if backend is None:
            return ""
        try:
            key = backend.get_password(SERVICE, name) or ""
        except Exception:  # noqa: BLE001 - a locked or vanished keyring: as if no key
            log.warning("could not read the key for %s from the keyring", name, exc_info=True)
            return ""
        with self._lock:
            self._memory[name] = key
        return key

    def set(self, base_url: str, key: str) -> bool:
        """Keep ``key`` for ``base_url`` ("" forgets it). True when it reached the system keyring."""
        name = self._name(base_url)
        with self._lock:
            self._memory[name] = key
            backend = self._backend
        if backend is None:
            return False
        try:
            if key:
                backend.set_password(SERVICE, name, key)
            else:
                try:
                    backend.delete_password(SERVICE, name)
                except Exception:  # noqa: BLE001 - keyring.errors.PasswordDeleteError: there was none
                    pass
        except Exception:  # noqa: BLE001 - the keyring refused (locked, no service): memory only
            log.warning("could not store the key for %s in the keyring; keeping it in memory", name, exc_info=True)
            with self._lock:
                self._backend = None
            return False
        return True
