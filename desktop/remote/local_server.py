"""Server > Serve the loaded model from this process: the window's own model, no second copy.

:class:`LocalServer` has :class:`desktop.remote.serve_toggle.ModelServer`'s face (``state``,
``changed``, ``url``, ``model_id``, ``device``, ``error``, ``options``, ``api_key``, ``start``,
``stop``, ``shutdown``) over a server object a factory makes from the worker's loaded model
(the command line hands the desktop :func:`attnchat.server.in_process.for_window`; the desktop
may not import attnchat). The server's engine runs on threads of its own over the same weights
as the chat: serving costs no second copy of them and no second load (the process server's
price: ~0.5 GiB and its load time for the default model). The chat keeps its own KV caches
and decodes beside the server's requests; they take turns at the model's kernels.

Starting (building the engine, binding, waiting for uvicorn to listen) and stopping (ending the
replies in progress, joining the server's thread) run on a short-lived thread, so the window
never waits on them; the result comes back as a queued signal. Closing the window waits for
the stop, at most :data:`SHUTDOWN_S`.

Must not import torch, runtime or attnchat.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from PySide6.QtCore import QObject, Signal

__all__ = ["LocalServer", "SHUTDOWN_S"]

log = logging.getLogger(__name__)

#: Seconds the window's close waits for the server to stop (its streams get their last chunk).
SHUTDOWN_S = 5.0


class LocalServer(QObject):
    """One in-process server at a time over the window's model.

    :attr:`state` is ``"stopped"``, ``"starting"``, ``"serving"`` or ``"failed"`` (then
    :attr:`error` says why, in one line); :attr:`changed` fires on each change.

    Args:
        factory: ``(model, *, port, api_key, options) -> server``; the server has ``start() -> url``,
            ``stop(timeout)``, ``reason`` (how it runs requests, in words) and ``app.state.model_id``.
    """

    changed = Signal(str)
    in_process = True
    _started = Signal(object, str, str)   # server (None when it failed), url, error: from the start thread
    _stopped = Signal(object)             # the server that has stopped: from the stop thread

    def __init__(self, factory: Callable[..., Any], parent: QObject | None = None):
        super().__init__(parent)
        self.factory = factory
        self._server: Any = None
        self._made: Any = None                     # the server the start thread made (read by shutdown)
        self._thread: threading.Thread | None = None
        self._starting = False
        self._stop_asked = False
        self._lines: list[str] = []   # read by the Server panel for the "one request at a time" reason
        self.state = "stopped"
        self.url = self.model_id = self.device = self.model_path = self.error = ""
        self.options: dict = {}
        self.api_key = ""
        self._started.connect(self._on_started)
        self._stopped.connect(self._on_stopped)

    @property
    def running(self) -> bool:
        """True from :meth:`start` until the server has stopped."""
        return self._starting or self._server is not None

    @property
    def pid(self) -> int:
        """This process: the server is part of it."""
        return os.getpid() if self.running else 0

    def start(self, model: Any, model_path: str, device: str, options: dict | None = None, api_key: str = "") -> None:
        """Serve ``model`` (the worker's loaded one; a no-op while a server runs). ``options``:
        the window's serve settings (context, cache_dtype, cache_policy, cache_budget, port)."""
        if self.running:
            return
        self.options, self.api_key = dict(options or {}), api_key
        self.url = self.error = ""
        self.model_id, self.model_path, self.device = os.path.basename(model_path), model_path, device
        self._lines, self._starting, self._stop_asked, self._made = [], True, False, None
        port = int(self.options.pop("port", 0) or 0)
        self._thread = threading.Thread(target=self._start, args=(model, port, dict(self.options), api_key),
                                        name="attnchat-serve-start", daemon=True)
        self._thread.start()
        self._set("starting")

    def _start(self, model: Any, port: int, options: dict, api_key: str) -> None:
        server = None
        try:
            server = self._made = self.factory(model, port=port, api_key=api_key, options=options)
            url = server.start()
        except Exception as e:  # noqa: BLE001 - said in one line; the traceback goes to the log
            log.info("the in-process server did not start", exc_info=True)
            if server is not None:
                server.stop(SHUTDOWN_S)
            lines = str(e).strip().splitlines()
            self._started.emit(None, "", lines[0] if lines else type(e).__name__)
            return
        self._started.emit(server, url, "")

    def _on_started(self, server: Any, url: str, error: str) -> None:
        if not self._starting:   # the window closed meanwhile: shutdown() stopped it
            return
        self._starting, self._made = False, None
        if server is None:
            self._finish(f"the server did not start: {error}")
            return
        self._server = server
        if self._stop_asked:   # unticked while it was starting
            self._stop_thread(server)
            return
        self.url = url
        self.model_id = str(getattr(getattr(server.app, "state", None), "model_id", "") or self.model_id)
        self._lines = [f"attnchat: {server.reason}"] if getattr(server, "reason", "") else []
        log.info("serving %s at %s from this process", self.model_id, url)
        self._set("serving")

    def stop(self) -> None:
        """Ask the server to stop (returns at once; :attr:`changed` says "stopped" when it has)."""
        if self._starting:
            self._stop_asked = True
        elif self._server is not None and not self._stop_asked:
            self._stop_asked = True
            self._stop_thread(self._server)

    def _stop_thread(self, server: Any) -> None:
        threading.Thread(target=lambda: (server.stop(SHUTDOWN_S), self._stopped.emit(server)),
                         name="attnchat-serve-stop", daemon=True).start()

    def _on_stopped(self, server: Any) -> None:
        if server is self._server:
            self._finish("")

    def shutdown(self, timeout_ms: int = int(SHUTDOWN_S * 1000)) -> None:
        """Stop the server and wait for it (the window is closing)."""
        self._stop_asked = True
        if self._starting and self._thread is not None:
            self._thread.join(timeout_ms / 1000)   # its server stops here, not after the window has gone
        server = self._server or self._made
        if server is None:
            return
        self._made = None
        server.stop(timeout_ms / 1000)
        self._starting = False
        self._finish("")

    def _finish(self, error: str) -> None:
        self._server = None
        self.error = error
        self.url = ""
        self._set("failed" if error else "stopped")

    def _set(self, state: str) -> None:
        self.state = state
        self.changed.emit(state)
