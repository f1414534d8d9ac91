"""The engine worker: owns the model and the chat sessions on the engine thread, and turns a
reply's runtime events into plain-data signals (text batched every ``batch_ms``).

Imports runtime's public API only (no torch, no widgets).
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator

from PySide6.QtCore import QObject, Signal, Slot

import runtime
from desktop.worker.errors import first_line, is_out_of_memory
from desktop.worker.generation_settings import generation_settings
from desktop.worker.model_info import model_info, model_key

__all__ = ["EngineWorker"]

log = logging.getLogger(__name__)


class _LoadFailed(Exception):
    """A model load failed; the message is the one line the user sees."""


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
    model_dropped = Signal()                 # the model loaded before is gone (a load needed its memory)
    prefill_progress = Signal(int, int)      # done, total prompt tokens
    text_batch = Signal(str)                 # new reply text since the last batch
    stats = Signal(object)                   # TurnStats.to_dict() + conv_id, request, model (model_key)
    finished = Signal(object)                # request, conv_id, kind, reason, text, stats (refused: too long)
    error = Signal(str)                      # one line for the user
    counted = Signal(object)                 # request, message_tokens, prompt_tokens, context_limit

    MAX_SESSIONS = 4

    def __init__(self, load_fn: Callable | None = None, session_fn: Callable | None = None,
                 batch_ms: int = 30):
        super().__init__()
        self._options: dict[str, Any] = {"weight_dtype": "auto"}   # set by configure()
        self._load_fn = load_fn or (lambda source, device: runtime.load_model(
            source or None, device=device, dtype=None if self._options["weight_dtype"] == "auto" else self._options["weight_dtype"],
            reproducible=bool(self._options.get("reproducible")) and runtime.resolve_device(device).type == "cpu"))
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

        A load that fails keeps the model loaded before it (and its conversations' caches),
        as LM Studio and GPT4All do: ``load_failed`` then says so, and the window goes on
        with it. Out of memory while both are held, the old one is let go and the load tried
        once more (the user asked for the new one).
        """
        fallback = None
        try:
            model, fallback = self._load_new(source, device)
        except MemoryError:
            if self._model is None:
                self.load_failed.emit(self.NO_MEMORY)
                return
            log.info("out of memory with two models held; unloading the old one and trying again")
            self._drop_model()
            try:
                model, fallback = self._load_new(source, device)
            except MemoryError:
                self.load_failed.emit(self.NO_MEMORY)
                return
            except _LoadFailed as e:
                self.load_failed.emit(str(e))
                return
        except _LoadFailed as e:
            self.load_failed.emit(str(e))
            return
        self._sessions.clear()
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

    NO_MEMORY = ("there is not enough memory for this model's weights; choose a smaller "
                 "model, a 16-bit weight dtype, or another device in Edit > Settings")

    def _load_new(self, source: str, device: str) -> tuple[Any, str | None]:
        """``(model, the device asked for when it fell back to auto, else None)``.

        Raises:
            MemoryError: out of memory (torch's OutOfMemoryError too).
            _LoadFailed: any other failure, in one line for the user.
        """
        try:
            try:
                return self._load_fn(source, device), None
            except runtime.DeviceError as e:
                if str(device or "auto").lower() == "auto":
                    raise
                # A settings file from another machine, or `--device cuda` without CUDA:
                # run where we can, and say so (the command line refuses instead: exit 2).
                log.info("device %s is not available (%s); loading on auto", device, e)
                return self._load_fn(source, "auto"), device
        except (runtime.AttnchatError, OSError, ValueError) as e:
            log.info("model load failed: %s", e)
            raise _LoadFailed(first_line(e)) from e
        except Exception as e:  # noqa: BLE001 - shown in one line, traceback to the log
            if is_out_of_memory(e):
                log.info("model load ran out of memory: %s", first_line(e))
                raise MemoryError(str(e)) from e
            log.exception("model load failed")
            raise _LoadFailed(f"the model could not be loaded ({type(e).__name__}: {first_line(e)}); "
                              "see the log for details") from e

    def _drop_model(self) -> None:
        self._sessions.clear()
        self._model = None
        self._model_key = ""
        gc.collect()
        self.model_dropped.emit()

    def token_model(self) -> str:
        """Whose tokenizer stored token ids belong to: the loaded model's path ("" for none)."""
        return str(getattr(self._model, "path", "") or "") if self._model is not None else ""

    @Slot(int, int, object, str, object)
    def send(self, request: int, conv_id: int, history: list, text: str, settings: dict) -> None:
        self._generate(request, conv_id, "send", history, settings, lambda s: s.send(text))

    @Slot(int, int, object, object)
    def regenerate(self, request: int, conv_id: int, history: list, settings: dict) -> None:
        self._generate(request, conv_id, "regenerate", history, settings, lambda s: s.regenerate())

    @Slot(int, int, object, str, object)
    def count(self, request: int, conv_id: int, history: list, text: str, settings: dict) -> None:
        """How many tokens ``text`` takes, and the prompt it would make after ``history`` (the
        chat template applied), against the context the reply would get: :attr:`counted`.
        Nothing when no model is loaded or the session cannot say (a server's)."""
        if self._model is None:
            return
        try:
            session = self._session(conv_id, settings)
            ids = getattr(session, "prompt_ids", None)
            tokenizer = getattr(self._model, "tokenizer", None)
            if ids is None or tokenizer is None:
                return
            kept = list(session.messages)
            session.messages = [runtime.Message(m[0], m[1]) for m in history] + [runtime.Message("user", text)]
            try:
                prompt = len(ids())
            finally:
                session.messages = kept
            message = len(tokenizer.encode(text, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a count is not worth an error line
            log.debug("could not count the tokens", exc_info=True)
            return
        self.counted.emit({"request": request, "message_tokens": message, "prompt_tokens": prompt,
                           "context_limit": int(getattr(session, "context_limit", 0) or 0)})

    @Slot(int)
    def forget(self, conv_id: int) -> None:
        """Drop a conversation's session (it was deleted)."""
        self._sessions.pop(conv_id, None)

    @Slot(object)
    def configure(self, options: dict) -> None:
        """Model options: ``weight_dtype`` (``"auto"`` or a dtype name) and ``reproducible`` (bool;
        on the CPU only), used by the next load, and ``attention_backend`` (``"fast"`` or
        ``"reference"``; from the next decode step)."""
        self._options.update({k: v for k, v in options.items() if k in ("weight_dtype", "attention_backend", "reproducible")})
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
            same_cache = (old.context_limit, old.cache_dtype, old.cache_limit_bytes, old.cache_policy,
                          old.cache_budget, old.cache_budget_bytes) == (
                gen.context_limit, gen.cache_dtype, gen.cache_limit_bytes, gen.cache_policy,
                gen.cache_budget, gen.cache_budget_bytes)
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
            # A message that can never fit: the window takes it back (nothing was generated).
            result["refused"] = isinstance(e, runtime.ContextOverflowError)
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
                    prefill = self._prefill_stats(session, ev, conv_id, request)
                    if prefill is not None:
                        self.stats.emit(prefill)
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

    def _prefill_stats(self, session, ev: "runtime.PrefillProgress", conv_id: int, request: int) -> dict | None:
        """The cache while a prompt is read (a 30 KB paste takes minutes): its figures now, marked
        ``prefill`` (done, total), so the panels move before the reply's first stats. None for a
        session without a cache of its own (a server's)."""
        cache = getattr(session, "cache", None)
        if cache is None or not callable(getattr(cache, "stats", None)):
            return None
        kv = cache.stats()
        return {"kv_cache": kv, "context_limit": int(getattr(session, "context_limit", 0) or 0),
                "context_used": int(kv.get("positions", kv.get("tokens", 0))), "prefill": {"done": ev.done, "total": ev.total},
                "model": self._model_key, "conv_id": conv_id, "request": request}

    def _stats(self, stats: "runtime.TurnStats", conv_id: int, request: int) -> dict:
        d = stats.to_dict()
        d["model"] = self._model_key   # whose figures these are (model_key)
        kv = d.get("kv_cache", {})
        # The conversation's tokens (under a cache policy the cache holds fewer: kv_cache["tokens"]).
        d["context_used"] = kv.get("positions", kv.get("tokens", d["prompt_tokens"] + d["completion_tokens"]))
        d["conv_id"], d["request"] = conv_id, request
        return d
