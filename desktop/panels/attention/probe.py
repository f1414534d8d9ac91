"""The attention view's model work, on the engine thread, behind plain-data signals.

:class:`AttentionProbe` lives on the engine worker's thread (it is moved there), so its
slots run between the worker's requests, one at a time, never during a reply; it
never touches a session's KV cache. It does four things:

- live capture: it wraps each reply's event stream (``EngineWorker.live_attention``).
  Only while the view asks for it (:meth:`AttentionProbe.set_active`, a thread-safe
  flag read before every event, so within one decode step) it holds a
  ``runtime.AttentionCapture(last_row_only=True)`` on the decoder and emits the newest
  token's attention, every layer and head, at most every :data:`LIVE_INTERVAL_S`.
  Inactive, the decoder's ``observer`` stays ``None`` and decode takes its fast path.
- snapshot: one extra forward over the conversation's token ids up to one layer
  (``runtime.LayerAttention``), sending one head's full matrix;
- atlas: ``runtime.head_scores`` once per model file (cached);
- the formula's numbers for one query token, from the same layer's q, k, v.

:class:`AttentionClient` is its GUI side (like ``desktop.worker.Engine``): it queues
requests with ids and forwards the results. Signals carry numpy arrays, lists, dicts
and strings, never tensors. Must not import torch or widgets.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Iterator

import numpy as np
from PySide6.QtCore import QObject, Signal, Slot

import runtime

__all__ = ["AttentionClient", "AttentionProbe", "LIVE_INTERVAL_S", "MAX_SNAPSHOT_TOKENS", "run_reported"]

log = logging.getLogger(__name__)

#: Shortest time between two live frames (s): the view redraws at most ~10 times a second.
LIVE_INTERVAL_S = 0.1
#: A snapshot covers at most this many tokens (the last ones): one head's float32 matrix
#: of 4,096 tokens is 64 MiB, and the softmax needs two more of it while it runs.
MAX_SNAPSHOT_TOKENS = 4096
#: Conversations whose last context (token ids the cache held) is remembered.
MAX_CONTEXTS = 8


def run_reported(fn, request: int, failed, what: str) -> None:
    """Run a probe's request ``fn`` on the engine thread; a failure goes to ``failed`` (a
    ``Signal(int, str)``) as one line for the user naming ``what`` failed, with an unexpected
    error's traceback in the log. Explain's cancel is said as such."""
    try:
        fn()
    except runtime.ExplainCancelled:
        failed.emit(request, "Explain cancelled.")
    except (runtime.AttnchatError, ValueError) as e:
        log.info("%s request failed: %s", what, e)
        failed.emit(request, str(e))
    except Exception as e:  # noqa: BLE001 - one line for the user, traceback to the log
        log.exception("%s request failed", what)
        failed.emit(request, f"{what} failed ({type(e).__name__}: {e}); see the log for details")


class AttentionProbe(QObject):
    """The engine-thread half of the attention view (see the module docstring).

    Args:
        worker: the ``desktop.worker.EngineWorker`` (its ``model`` is read, and its
            ``live_attention`` hook set to :meth:`wrap`).

    Signals (every result dict carries its ``request`` id):
        live: ``{"conv_id", "weights": float32 (L, H, Tk), "tokens": [str] (Tk), "final": bool}``, and
            under a cache policy that evicted tokens ``"kept"``: float32 (L, Tk), the share of each
            layer's KV heads still holding each token (``runtime.kept_share``), and ``"cache_policy"``.
        snapshot_ready: ``{"request", "conv_id", "layer", "head", "matrix": float32 (T, T),
            "window": the layer's sliding window (tokens) or None, "tokens": [str] (T),
            "offset": first token's position in the conversation, "total"}``.
        atlas_ready: ``{"request", "model", "induction": float32 (L, H), "previous_token": (L, H),
            "repeat_len", "batch", "windows": each layer's sliding window or None}``.
        numbers_ready: ``runtime.FormulaSteps`` as a dict, plus ``request``, ``conv_id``,
            ``tokens`` (the key tokens' texts), ``query_token``, ``offset``, ``total``.
        failed: ``(request, one line)``.
    """

    live = Signal(object)
    snapshot_ready = Signal(object)
    atlas_ready = Signal(object)
    numbers_ready = Signal(object)
    failed = Signal(int, str)

    REPEAT_LEN, BATCH = 50, 4  # the probe's defaults (runtime.head_scores, `attnchat heads`)

    def __init__(self, worker):
        super().__init__()
        self._worker = worker
        self._active = threading.Event()
        self._atlas: dict[str, dict] = {}               # model path -> scores
        self._texts: dict[int, str] = {}                 # token id -> text, for one model
        self._texts_model: str | None = None
        self._contexts: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # conv_id -> (model, ids in its cache)
        self._layer: tuple[tuple, Any] | None = None     # (key, runtime.LayerAttention): the last one
        worker.live_attention = self.wrap

    # ---- called from the GUI thread ------------------------------------------------------
    def set_active(self, on: bool) -> None:
        """Capture live attention from the next event on (thread-safe)."""
        if on:
            self._active.set()
        else:
            self._active.clear()

    @property
    def active(self) -> bool:
        return self._active.is_set()

    def last_context(self, conv_id: int) -> list[int]:
        """The token ids the conversation's KV cache held after its last reply (empty: none seen)."""
        return list(self._contexts.get(conv_id, ("", []))[1])

    def held_ids(self, conv_id: int, model) -> list[int]:
        """:meth:`last_context` if ``model`` wrote it (empty otherwise)."""
        model_path, ids = self._contexts.get(conv_id, ("", []))
        return list(ids) if model_path == str(model.path) else []

    # ---- live capture (the engine thread, inside a reply) --------------------------------
    def wrap(self, conv_id: int, session, events: Iterator) -> Iterator:
        """Yield ``events`` unchanged; while active, capture the newest token's attention."""
        model = getattr(session, "model", None)
        if getattr(model, "decoder", None) is None:  # not a runtime session (tests' fakes)
            yield from events
            return
        cap = None
        seen, last = 0, 0.0
        try:
            for ev in events:
                # Before each event: the session runs the next forward when we ask for the next one.
                on = self._active.is_set()
                if on and cap is None:
                    cap = runtime.AttentionCapture(model, last_row_only=True).__enter__()
                elif not on and cap is not None:
                    cap.__exit__(None, None, None)
                    cap = None
                final = isinstance(ev, runtime.Finish)
                # The final frame goes out even when the last step's frame already did (a
                # slow step, over LIVE_INTERVAL_S, emits every frame): the panel waits for it.
                if cap is not None and (final or cap.version != seen):
                    now = time.perf_counter()
                    if final or now - last >= LIVE_INTERVAL_S:
                        self._emit_live(conv_id, session, cap, final)
                        seen, last = cap.version, now
                yield ev
        finally:
            if cap is not None:
                cap.__exit__(None, None, None)
            self._remember(conv_id, session)

    def _emit_live(self, conv_id: int, session, cap, final: bool) -> None:
        model = session.model
        n = model.config.n_layers
        if len(cap.weights) < n:
            return
        ids = runtime.context_ids(session)
        rows = [cap.weights[i][0] for i in range(n)]  # (H, Tk) each
        if any(r.shape[-1] != len(ids) for r in rows):  # the cache changed since (truncation)
            return
        weights = np.stack([r.numpy() for r in rows]).astype(np.float32, copy=False)  # (L, H, Tk)
        frame = {"conv_id": conv_id, "weights": weights, "tokens": self._tokens(model, ids), "final": final}
        kept = runtime.kept_share(session)  # under a cache policy: what each layer still holds
        if kept is not None:
            frame["kept"] = kept.numpy()  # (L, Tk)
            frame["cache_policy"] = session.settings.cache_policy
        self.live.emit(frame)

    def _remember(self, conv_id: int, session) -> None:
        try:
            ids = runtime.context_ids(session)
        except AttributeError:
            return
        if ids:
            self._contexts[conv_id] = (str(session.model.path), ids)
            self._contexts.move_to_end(conv_id)
            while len(self._contexts) > MAX_CONTEXTS:
                self._contexts.popitem(last=False)

    def _tokens(self, model, ids: list[int]) -> list[str]:
        if self._texts_model != str(model.path):
            self._texts, self._texts_model = {}, str(model.path)
        return runtime.token_strings(model, ids, self._texts)

    # ---- requests (the engine thread, between replies) -----------------------------------
    def _model(self):
        model = self._worker.model
        if model is None:
            raise runtime.ModelLoadError("no model is loaded; open one with File > Open model")
        if getattr(model, "decoder", None) is None:
            raise ValueError("the attention view needs a model running in this app, not on a server")
        return model

    def _ids(self, model, conv_id: int, history: list, system: str) -> list[int]:
        """What the model attended over: the ids its cache held after the last reply, else the
        stored conversation through the chat template."""
        model_path, ids = self._contexts.get(conv_id, ("", None))
        if not ids or model_path != str(model.path):
            msgs = [runtime.Message(role, content) for role, content in history]
            ids = runtime.conversation_ids(model, msgs, system or None)
        if not ids:
            raise ValueError("the conversation is empty: send a message first")
        return ids

    def _layer_attention(self, model, ids: list[int], layer: int):
        key = (str(model.path), str(model.dtype), len(ids), hash(tuple(ids)), layer)
        if self._layer is None or self._layer[0] != key:
            self._layer = None  # free the old q, k, v first
            self._layer = (key, runtime.LayerAttention(model, ids, layer))
        return self._layer[1]

    def _run(self, request: int, fn) -> None:
        run_reported(fn, request, self.failed, "the attention view")

    @Slot(int, int, object, str, int, object)
    def snapshot(self, request: int, conv_id: int, history: list, system: str, layer: int, head) -> None:
        def go():
            model = self._model()
            ids = self._ids(model, conv_id, history, system)
            offset = max(0, len(ids) - MAX_SNAPSHOT_TOKENS)
            window = ids[offset:]
            matrix = self._layer_attention(model, window, layer).matrix(head).numpy().astype(np.float32, copy=False)
            self.snapshot_ready.emit({"request": request, "conv_id": conv_id, "layer": layer, "head": head,
                                      "matrix": matrix, "window": model.config.window(layer), "tokens": self._tokens(model, window),
                                      "offset": offset, "total": len(ids)})
        self._run(request, go)

    @Slot(int, int, object, str, int, int, int, int)
    def explain(self, request: int, conv_id: int, history: list, system: str, layer: int, head: int,
                query: int, top: int) -> None:
        def go():
            model = self._model()
            ids = self._ids(model, conv_id, history, system)
            offset = max(0, len(ids) - MAX_SNAPSHOT_TOKENS)
            window = ids[offset:]
            if 0 <= query < offset:
                raise ValueError(f"token #{query} is before the last {MAX_SNAPSHOT_TOKENS:,} tokens the view covers")
            q = query - offset if query >= 0 else query
            steps = self._layer_attention(model, window, layer).explain(head, q, top=top).to_dict()
            texts = self._tokens(model, window)
            steps.update(request=request, conv_id=conv_id, tokens=[texts[j] for j in steps["keys"]],
                         query_token=texts[steps["query"]], offset=offset, total=len(ids))
            self.numbers_ready.emit(steps)
        self._run(request, go)

    @Slot(int)
    def atlas(self, request: int) -> None:
        def go():
            model = self._model()
            key = str(model.path)
            if key not in self._atlas:
                s = runtime.head_scores(model, repeat_len=self.REPEAT_LEN, batch=self.BATCH)
                self._atlas[key] = {"model": model.name, "repeat_len": self.REPEAT_LEN, "batch": self.BATCH,
                                    "windows": list(model.config.windows),
                                    "induction": np.asarray(s.induction, dtype=np.float32),
                                    "previous_token": np.asarray(s.previous_token, dtype=np.float32)}
            self.atlas_ready.emit({**self._atlas[key], "request": request})
        self._run(request, go)


class AttentionClient(QObject):
    """The GUI side: owns an :class:`AttentionProbe` on the engine's thread, queues requests.

    Each request method returns its id; the matching ``*_ready`` or :attr:`failed`
    signal carries it back.
    """

    live = Signal(object)
    snapshot_ready = Signal(object)
    atlas_ready = Signal(object)
    numbers_ready = Signal(object)
    failed = Signal(int, str)

    _snapshot = Signal(int, int, object, str, int, object)
    _explain = Signal(int, int, object, str, int, int, int, int)
    _atlas = Signal(int)

    def __init__(self, engine, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine   # the insight client asks it when the thread ends
        self.probe = AttentionProbe(engine.worker)
        self.probe.moveToThread(engine.worker.thread())
        self._request = 0
        self._snapshot.connect(self.probe.snapshot)
        self._explain.connect(self.probe.explain)
        self._atlas.connect(self.probe.atlas)
        p = self.probe
        for name in ("live", "snapshot_ready", "atlas_ready", "numbers_ready", "failed"):
            getattr(p, name).connect(getattr(self, name))

    def set_active(self, on: bool) -> None:
        """Capture live attention during replies (True) or not at all (False)."""
        self.probe.set_active(on)

    def _next(self) -> int:
        self._request += 1
        return self._request

    def snapshot(self, conv_id: int, history: list, system: str, layer: int, head) -> int:
        """``head``: an index, ``"mean"`` or ``"max"``."""
        r = self._next()
        self._snapshot.emit(r, conv_id, list(history), system or "", layer, head)
        return r

    def explain(self, conv_id: int, history: list, system: str, layer: int, head: int, query: int, top: int = 5) -> int:
        """``query``: a token position in the conversation (negative: from the end)."""
        r = self._next()
        self._explain.emit(r, conv_id, list(history), system or "", layer, head, query, top)
        return r

    def atlas(self) -> int:
        r = self._next()
        self._atlas.emit(r)
        return r
