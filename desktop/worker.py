"""The engine worker: all model work, on one long-lived QThread, behind plain-data signals.

Why a thread and not a process: torch releases the GIL inside its kernels, so a
decode step on the worker thread leaves the GUI thread free; the model (and, later,
the attention captures and KV-cache figures the panels show) is shared without
copying or pickling; Stop is one ``threading.Event`` set from the GUI thread, seen
within one decode step; and shutdown is ``stop -> quit -> wait``. A process would
buy isolation from crashes inside torch at the price of a second copy of the
runtime in memory, IPC for every token and attention map, and a slower start.

Requests go in through :class:`Engine` (GUI side), which queues them onto the
worker's thread; results come back as signals carrying only ``str``, ``int``,
``dict`` and ``list`` (never tensors). Text is batched: at most one
:attr:`EngineWorker.text_batch` every ``batch_ms`` (30 ms), so the window repaints
at most ~33 times a second however fast tokens come.

Imports runtime's public API only (no torch, no widgets).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator

from PySide6.QtCore import QObject, QThread, Signal, Slot

import runtime

__all__ = ["Engine", "EngineWorker", "generation_settings", "live_threads", "model_key", "start_thread"]

log = logging.getLogger(__name__)

_THREADS: "weakref.WeakSet[QThread]" = weakref.WeakSet()


def start_thread(name: str, obj: QObject | None = None, run: Callable | None = None) -> QThread:
    """A started QThread, remembered so tests can check none is left running.

    ``obj`` (if given) is moved onto it first, and ``run`` connected to its ``started``.
    """
    thread = QThread()
    thread.setObjectName(name)
    if obj is not None:
        obj.moveToThread(thread)
    if run is not None:
        thread.started.connect(run)
    _THREADS.add(thread)
    thread.start()
    return thread


def live_threads() -> list[QThread]:
    """Threads made by :func:`start_thread` that are still running."""
    out = []
    for t in list(_THREADS):
        try:
            if t.isRunning():
                out.append(t)
        except RuntimeError:  # the C++ object is gone: not running
            pass
    return out


def generation_settings(s: dict[str, Any], max_context: int | None = None) -> "runtime.GenerationSettings":
    """The runtime's settings from the desktop's plain dict (keys as in ``desktop.settings.values``).

    ``seed`` < 0 or None: a fresh seed per reply; ``cache_dtype`` ``"auto"``: the compute
    dtype (:func:`runtime.compute_dtype`); ``cache_limit_mib`` 0: no limit; ``context`` 0: the model's maximum, and a
    context past ``max_context`` (a model loaded after it was set) is capped there.

    Raises:
        ValueError: a value out of range.
    """
    seed = s.get("seed")
    sampling = runtime.SamplingParams(
        temperature=float(s.get("temperature", 0.0)), top_k=int(s.get("top_k", 0)), top_p=float(s.get("top_p", 1.0)),
        min_p=float(s.get("min_p", 0.0)), repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        seed=None if seed is None or int(seed) < 0 else int(seed))
    context = int(s["context"]) if s.get("context") else None
    if context and max_context:
        context = min(context, max_context)
    cache_dtype = s.get("cache_dtype") or "auto"
    limit_mib = float(s.get("cache_limit_mib") or 0.0)
    return runtime.GenerationSettings(
        sampling=sampling,
        max_new_tokens=int(s.get("max_new_tokens", 512)),
        context_limit=context,
        overflow=str(s.get("overflow", "truncate-middle")),
        sink_tokens=int(s.get("sink_tokens", 4)),
        cache_dtype=None if cache_dtype == "auto" else str(cache_dtype),
        cache_limit_bytes=int(limit_mib * 2**20) if limit_mib > 0 else None,
    )


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def is_out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, or torch's (CUDA/MPS) OutOfMemoryError, told apart without importing torch."""
    return isinstance(e, MemoryError) or any(t.__name__ == "OutOfMemoryError" for t in type(e).__mro__)


def model_info(model: "runtime.Model") -> dict[str, Any]:
    """A plain-data description of a loaded model (for the status bar and the panels)."""
    if getattr(model, "remote", False):  # a server's model describes itself (desktop.remote.engine)
        return model.info()
    c = model.config
    dtype = str(model.dtype).removeprefix("torch.")
    return {
        "name": model.name, "path": str(model.path), "device": str(model.device), "dtype": dtype,
        "compute_dtype": str(getattr(model, "compute_dtype", model.dtype)).removeprefix("torch."),
        "context_limit": c.max_position_embeddings, "n_layers": c.n_layers, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "load_seconds": model.load_seconds,
        "weights_bytes": getattr(model, "weights_bytes", None),
        "chat_template": bool(getattr(model, "has_chat_template", True)),
        # What the template sends as the system prompt when none is set (SmolLM2's names itself).
        "builtin_system_prompt": runtime.builtin_system_prompt(getattr(model, "tokenizer", None)),
        # Per layer its sliding window in tokens, or None (full attention).
        "layer_windows": list(getattr(c, "windows", ())),
    }


def model_key(info: dict | None) -> str:
    """Which model a reply came from, as its stats record it (``stats["model"]``): a server's
    source (address and model id), else the model file's or folder's path; "" for none."""
    return str((info or {}).get("source") or (info or {}).get("path") or "")


class EngineWorker(QObject):
    """Owns the model and one :class:`runtime.ChatSession` per conversation (the 4 most recent).

    Lives on the engine thread; its slots run there one at a time. :meth:`stop` is
    the exception: it is called directly from the GUI thread and is thread-safe.

    Args:
        load_fn: ``(source, device) -> model`` (default :func:`runtime.load_model`).
        session_fn: ``(model, system_prompt, settings) -> session`` (default
            :class:`runtime.ChatSession`). Tests pass scripted fakes for both.
        batch_ms: shortest time between two :attr:`text_batch` signals (ms).
    """

    model_loaded = Signal(object)
    load_failed = Signal(str)
    prefill_progress = Signal(int, int)      # done, total prompt tokens
    text_batch = Signal(str)                 # new reply text since the last batch
    stats = Signal(object)                   # TurnStats.to_dict() + conv_id, request, model (model_key)
    finished = Signal(object)                # request, conv_id, kind, reason, text, stats
    error = Signal(str)                      # one line for the user

    MAX_SESSIONS = 4

    def __init__(self, load_fn: Callable | None = None, session_fn: Callable | None = None,
                 batch_ms: int = 30):
        super().__init__()
        self._options: dict[str, Any] = {"weight_dtype": "auto"}   # set by configure()
        self._load_fn = load_fn or (lambda source, device: runtime.load_model(
            source or None, device=device, dtype=None if self._options["weight_dtype"] == "auto" else self._options["weight_dtype"]))
        self._session_fn = session_fn or (
            lambda model, system, settings: runtime.ChatSession(model, system_prompt=system, settings=settings))
        self._batch_s = batch_ms / 1000.0
        self._model = None
        self._model_key = ""
        self._sessions: OrderedDict[int, Any] = OrderedDict()
        self._current = None            # the session generating now (read by stop())
        self._cancel_upto = 0           # requests with ids <= this are cancelled
        self._lock = threading.Lock()
        # (conv_id, session, events) -> events: the attention view's live capture wraps each
        # reply's event stream here (desktop.panels.attention.probe); None: nothing is wrapped.
        self.live_attention: Callable[[int, Any, Iterator], Iterator] | None = None

    @property
    def model(self):
        """The loaded ``runtime.Model`` (None before a load); for objects on the engine thread."""
        return self._model

    # ---- called from the GUI thread ------------------------------------------------------
    def stop(self, request: int) -> None:
        """Cancel ``request`` and every earlier one (thread-safe; within one decode step)."""
        with self._lock:
            self._cancel_upto = max(self._cancel_upto, request)
            session = self._current
        if session is not None:
            session.cancel()

    # ---- slots (the engine thread) -------------------------------------------------------
    @Slot(str, str)
    def load_model(self, source: str, device: str) -> None:
        """Load ``source`` on ``device``; a device that is not here falls back to ``auto``.

        ``model_loaded``'s dict then carries ``device_fallback`` (the device asked for) and
        ``notices``: one-line sentences for the user (that fallback; a model without a
        chat template, which gets a plain format).
        """
        self._sessions.clear()
        self._model = None
        fallback = None
        try:
            try:
                model = self._load_fn(source, device)
            except runtime.DeviceError as e:
                if str(device or "auto").lower() == "auto":
                    raise
                # A settings file from another machine, or `--device cuda` without CUDA:
                # run where we can, and say so (the command line refuses instead: exit 2).
                log.info("device %s is not available (%s); loading on auto", device, e)
                fallback = device
                model = self._load_fn(source, "auto")
        except (runtime.AttnchatError, OSError, ValueError) as e:
            log.info("model load failed: %s", e)
            self.load_failed.emit(first_line(e))
            return
        except Exception as e:  # noqa: BLE001 - shown in one line, traceback to the log
            log.exception("model load failed")
            if is_out_of_memory(e):
                self.load_failed.emit("there is not enough memory for this model's weights; choose a smaller "
                                      "model, a 16-bit weight dtype, or another device in Edit > Settings")
            else:
                self.load_failed.emit(f"the model could not be loaded ({type(e).__name__}: {first_line(e)}); "
                                      "see the log for details")
            return
        self._model = model
        info = model_info(model)
        self._model_key = model_key(info)
        notices = []
        if fallback is not None:
            info["device_fallback"] = fallback
            notices.append(f"The device {fallback} is not available on this machine, so the model runs on "
                           f"{info['device']} instead; choose a device in Edit > Settings.")
        if not info.get("chat_template", True):
            notices.append(f"{info['name']} has no chat template: it runs as plain text completion "
                           "(it continues what you write).")
        info["notices"] = notices
        self.model_loaded.emit(info)

    def token_model(self) -> str:
        """Whose tokenizer stored token ids belong to: the loaded model's path ("" for none)."""
        return str(getattr(self._model, "path", "") or "") if self._model is not None else ""

    @Slot(int, int, object, str, object)
    def send(self, request: int, conv_id: int, history: list, text: str, settings: dict) -> None:
        self._generate(request, conv_id, "send", history, settings, lambda s: s.send(text))

    @Slot(int, int, object, object)
    def regenerate(self, request: int, conv_id: int, history: list, settings: dict) -> None:
        self._generate(request, conv_id, "regenerate", history, settings, lambda s: s.regenerate())

    @Slot(int)
    def forget(self, conv_id: int) -> None:
        """Drop a conversation's session (it was deleted)."""
        self._sessions.pop(conv_id, None)

    @Slot(object)
    def configure(self, options: dict) -> None:
        """Model options: ``weight_dtype`` (``"auto"`` or a dtype name; used by the next load)
        and ``attention_backend`` (``"fast"`` or ``"reference"``; from the next decode step)."""
        self._options.update({k: v for k, v in options.items() if k in ("weight_dtype", "attention_backend")})
        backend = options.get("attention_backend")
        if backend:
            try:
                runtime.set_attention_backend(backend)
            except ValueError as e:
                self.error.emit(str(e))

    # ---- generation ----------------------------------------------------------------------
    def _session(self, conv_id: int, settings: dict):
        gen = generation_settings(settings, self._model.config.max_position_embeddings)
        system = settings.get("system_prompt") or None
        session = self._sessions.get(conv_id)
        if session is not None:
            old = session.settings
            same_cache = (old.context_limit, old.cache_dtype, old.cache_limit_bytes) == (
                gen.context_limit, gen.cache_dtype, gen.cache_limit_bytes)
            if not same_cache:
                session = None
            else:
                session.settings = gen
                session.system_prompt = system
        if session is None:
            session = self._session_fn(self._model, system, gen)
            self._sessions[conv_id] = session
        self._sessions.move_to_end(conv_id)
        while len(self._sessions) > self.MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def _generate(self, request: int, conv_id: int, kind: str, history: list, settings: dict,
                  start: Callable[[Any], Iterator]) -> None:
        result = {"request": request, "conv_id": conv_id, "kind": kind, "reason": "error", "text": "", "stats": {}}
        try:
            if self._model is None:
                raise runtime.ModelLoadError("no model is loaded; open one with File > Open model")
            session = self._session(conv_id, settings)
            # The database is the truth: the session re-prefills whatever differs from its cache.
            # A reply keeps the ids the model wrote when they came from this model's tokenizer.
            key = self.token_model()
            session.messages = [runtime.Message(m[0], m[1], m[2] if len(m) > 3 and key and m[3] == key else None)
                                for m in history]
            with self._lock:
                cancelled = request <= self._cancel_upto
                self._current = session
            if cancelled:
                result["reason"] = "cancelled"
                return
            events = start(session)
            if self.live_attention is not None:
                events = self.live_attention(conv_id, session, events)
            self._stream(request, conv_id, session, events, result)
        except (runtime.AttnchatError, ValueError) as e:
            log.info("generation failed: %s", e)
            self.error.emit(first_line(e))
        except Exception as e:  # noqa: BLE001 - one line for the user, the traceback to the log
            log.exception("generation failed")
            # The failure may have come mid-step: rebuild this conversation's cache next time.
            self._sessions.pop(conv_id, None)
            if is_out_of_memory(e):
                self.error.emit("out of memory while writing the reply; lower the context length or the "
                                "KV-cache limit, or use a smaller cache dtype, in Edit > Settings")
            else:
                self.error.emit(f"the reply failed ({type(e).__name__}: {first_line(e)}); see the log for details")
        finally:
            with self._lock:
                self._current = None
            self.finished.emit(result)

    def _stream(self, request: int, conv_id: int, session, events: Iterator, result: dict) -> None:
        pending: list[str] = []
        last_text = last_progress = 0.0
        for ev in events:
            if self._cancel_upto >= request:
                session.cancel()
            now = time.perf_counter()
            if isinstance(ev, runtime.TextPiece):
                pending.append(ev.text)
                if now - last_text >= self._batch_s:
                    self.text_batch.emit("".join(pending))
                    pending.clear()
                    last_text = now
            elif isinstance(ev, runtime.PrefillProgress):
                if ev.done == ev.total or now - last_progress >= self._batch_s:
                    self.prefill_progress.emit(ev.done, ev.total)
                    last_progress = now
            elif isinstance(ev, runtime.StatsUpdate):
                self.stats.emit(self._stats(ev.stats, conv_id, request))
            elif isinstance(ev, runtime.Finish):
                if pending:
                    self.text_batch.emit("".join(pending))
                    pending.clear()
                stats = self._stats(ev.stats, conv_id, request)
                self.stats.emit(stats)
                result.update(reason=ev.reason, text=ev.text, stats=stats)
                last = session.messages[-1] if session.messages else None
                if last is not None and last.role == "assistant" and last.content == ev.text:
                    ids = getattr(last, "token_ids", None)
                    result.update(token_ids=ids, token_model=self.token_model() if ids is not None else "")

    def _stats(self, stats: "runtime.TurnStats", conv_id: int, request: int) -> dict:
        d = stats.to_dict()
        d["model"] = self._model_key   # whose figures these are (model_key)
        d["context_used"] = d.get("kv_cache", {}).get("tokens", d["prompt_tokens"] + d["completion_tokens"])
        d["conv_id"], d["request"] = conv_id, request
        return d


class Engine(QObject):
    """The GUI side of the worker: starts its thread, queues requests, forwards results.

    Every request gets an id (``int``); :attr:`finished` carries it back exactly once.
    ``busy`` is true from a request until its ``finished``.
    """

    model_loaded = Signal(object)
    load_failed = Signal(str)
    load_started = Signal(str)
    prefill_progress = Signal(int, int)
    text_batch = Signal(str)
    stats = Signal(object)
    finished = Signal(object)
    error = Signal(str)

    _load = Signal(str, str)
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
        self.model: dict | None = None
        self._load.connect(self.worker.load_model)
        self._send.connect(self.worker.send)
        self._regenerate.connect(self.worker.regenerate)
        self._forget.connect(self.worker.forget)
        self._configure.connect(self.worker.configure)
        w = self.worker
        w.model_loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.prefill_progress.connect(self.prefill_progress)
        w.text_batch.connect(self.text_batch)
        w.stats.connect(self.stats)
        w.error.connect(self.error)
        w.finished.connect(self._on_finished)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.isRunning()

    def load(self, source: str = "", device: str = "auto") -> None:
        self.loading = True
        self.model = None
        self.load_started.emit(source)
        self._load.emit(source, device)

    def send(self, conv_id: int, history: list, text: str, settings: dict) -> int:
        return self._queue(self._send, conv_id, list(history), text, dict(settings))

    def regenerate(self, conv_id: int, history: list, settings: dict) -> int:
        return self._queue(self._regenerate, conv_id, list(history), dict(settings))

    def forget(self, conv_id: int) -> None:
        self._forget.emit(conv_id)

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
        self._thread.quit()
        ok = self._thread.wait(timeout_ms)
        if not ok:
            log.warning("the engine thread did not end within %d ms", timeout_ms)
        self._thread = None
        return ok

    def _on_loaded(self, info: dict) -> None:
        self.loading = False
        self.model = info
        self.model_loaded.emit(info)

    def _on_load_failed(self, message: str) -> None:
        self.loading = False
        self.load_failed.emit(message)

    def _on_finished(self, result: dict) -> None:
        self._running.discard(result["request"])
        self.finished.emit(result)
