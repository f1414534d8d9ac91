"""The GUI side of the engine worker: starts its thread, queues requests as signals, and
forwards the worker's results; every request has an id that :attr:`Engine.finished` carries back once.

Imports no runtime and no torch.
"""
from __future__ import annotations

import logging

from PySide6.QtCore import QObject, Signal

from desktop.worker.engine_worker import EngineWorker
from desktop.worker.threads import start_thread

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine(QObject):
    """The GUI side of the worker: starts its thread, queues requests, forwards results.

    Every request gets an id (``int``); :attr:`finished` carries it back exactly once.
    ``busy`` is true from a request until its ``finished``. While a load runs :attr:`model`
    is None; a load that fails gives back the model loaded before it (the worker keeps it).
    """

    model_loaded = Signal(object)
    load_failed = Signal(str)
    load_started = Signal(str)
    prefill_progress = Signal(int, int)
    text_batch = Signal(str)
    stats = Signal(object)
    finished = Signal(object)
    error = Signal(str)
    counted = Signal(object)   # EngineWorker.count's answer
    # shutdown() is ending the thread: whoever runs long work on it (Explain) stops it now,
    # or the thread ends only when that work does (emitted on the GUI thread, before the wait).
    stopping = Signal()

    _load = Signal(str, str)
    _count = Signal(int, int, object, str, object)
    _send = Signal(int, int, object, str, object)
    _regenerate = Signal(int, int, object, object)
    _forget = Signal(int)
    _configure = Signal(object)

    def __init__(self, worker: EngineWorker | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.worker = worker or EngineWorker()
        self._thread = start_thread("attnchat-engine", self.worker)
        self._request = 0
        self._running: set[int] = set()
        self.loading = False
        #: Other long work that holds the engine's thread now ("Explain"; "" for none), set by
        #: whoever queued it: a request queued now waits for it, and the window says so.
        self.holding = ""
        self.model: dict | None = None
        self._previous: dict | None = None   # the model held while another loads
        self._load.connect(self.worker.load_model)
        self._send.connect(self.worker.send)
        self._regenerate.connect(self.worker.regenerate)
        self._forget.connect(self.worker.forget)
        self._count.connect(self.worker.count)
        self._configure.connect(self.worker.configure)
        w = self.worker
        w.model_loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.model_dropped.connect(self._on_dropped)
        w.prefill_progress.connect(self.prefill_progress)
        w.text_batch.connect(self.text_batch)
        w.stats.connect(self.stats)
        w.error.connect(self.error)
        w.counted.connect(self.counted)
        w.finished.connect(self._on_finished)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.isRunning()

    def load(self, source: str = "", device: str = "auto") -> None:
        self.loading = True
        if self.model is not None:
            self._previous = self.model
        self.model = None
        self.load_started.emit(source)
        self._load.emit(source, device)

    def send(self, conv_id: int, history: list, text: str, settings: dict) -> int:
        return self._queue(self._send, conv_id, list(history), text, dict(settings))

    def regenerate(self, conv_id: int, history: list, settings: dict) -> int:
        return self._queue(self._regenerate, conv_id, list(history), dict(settings))

    def forget(self, conv_id: int) -> None:
        self._forget.emit(conv_id)

    def count(self, conv_id: int, history: list, text: str, settings: dict) -> int:
        """Ask how many tokens ``text`` takes after ``history`` (:attr:`counted` answers, with
        this id; not a reply: ``busy`` and ``finished`` are not touched)."""
        self._count_request = getattr(self, "_count_request", 0) + 1
        self._count.emit(self._count_request, conv_id, list(history), text, dict(settings))
        return self._count_request

    def configure(self, options: dict) -> None:
        """Queue :meth:`EngineWorker.configure` (before a load, it applies to that load)."""
        self._configure.emit(dict(options))

    def _queue(self, signal, *args) -> int:
        self._request += 1
        self._running.add(self._request)
        signal.emit(self._request, *args)
        return self._request

    def stop(self) -> None:
        """Stop the reply in progress and any queued (takes effect within one decode step)."""
        self.worker.stop(self._request)

    def shutdown(self, timeout_ms: int = 60_000) -> bool:
        """Stop, quit the thread and wait for it; True when it ended."""
        if self._thread is None:
            return True
        self.stop()
        self.stopping.emit()
        self._thread.quit()
        ok = self._thread.wait(timeout_ms)
        if not ok:
            log.warning("the engine thread did not end within %d ms", timeout_ms)
        self._thread = None
        return ok

    def _on_loaded(self, info: dict) -> None:
        self.loading = False
        self.model, self._previous = info, None
        self.model_loaded.emit(info)

    def _on_load_failed(self, message: str) -> None:
        self.loading = False
        self.model, self._previous = self._previous, None   # the worker still holds it
        self.load_failed.emit(message)

    def _on_dropped(self) -> None:
        self._previous = None

    def _on_finished(self, result: dict) -> None:
        self._running.discard(result["request"])
        self.finished.emit(result)
