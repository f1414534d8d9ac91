"""The insight views' model work (explain a token, knock heads out, the induction test,
attention time per decode step), on the engine thread, behind plain-data signals.

:class:`InsightProbe` lives on the engine worker's thread beside
:class:`desktop.panels.attention.probe.AttentionProbe` (whose model, conversation ids,
token texts and head atlas it reuses), so its slots run between replies, never during
one, and never touch a session's KV cache. :class:`InsightClient` is its GUI side.
Signals carry numpy arrays, lists, dicts and strings, never tensors. Must not import
torch or widgets.
"""
from __future__ import annotations

import logging

import numpy as np
from PySide6.QtCore import QObject, Signal, Slot

import runtime

__all__ = ["InsightClient", "InsightProbe", "MAX_EXPLAIN_TOKENS", "MAX_KNOCKOUT_TOKENS"]

log = logging.getLogger(__name__)

#: Explain looks at most this many context tokens before the chosen token (the last ones):
#: integrated gradients run a forward and a backward per step over all of them.
MAX_EXPLAIN_TOKENS = 512
#: Knock-out runs two forwards over at most this many tokens before the chosen one.
MAX_KNOCKOUT_TOKENS = 4096


class InsightProbe(QObject):
    """The engine-thread half (see the module docstring).

    Signals (every result dict carries its ``request`` id):
        explain_ready: ``runtime.Explanation`` as a dict, plus ``tokens`` (the context's
            texts), ``token`` (the chosen token's text), ``offset`` (the window's first
            position in the conversation).
        knockout_ready: ``{"heads", "mode", "position", "token", "before", "after"}``;
            ``before``/``after``: ``{"prob", "top": [(text, prob)]}``.
        induction_ready: ``runtime.InductionAblation`` as a dict.
        cost_ready: ``runtime.AttentionStepTime`` as a dict.
        failed: ``(request, one line)``.
    """

    explain_ready = Signal(object)
    knockout_ready = Signal(object)
    induction_ready = Signal(object)
    cost_ready = Signal(object)
    failed = Signal(int, str)

    def __init__(self, attention_probe):
        super().__init__()
        self._ap = attention_probe

    def _target(self, model, conv_id: int, history: list, system: str, position: int) -> tuple[list[int], int]:
        """The conversation's ids and the chosen token's position (``-1``: the newest reply token)."""
        msgs = [runtime.Message(role, content) for role, content in history]
        ids, reply = runtime.reply_positions(model, msgs, system or None)
        if not ids:
            raise ValueError("the conversation is empty: send a message first")
        if position < 0:
            t = reply[-1] if len(reply) else len(ids) - 1
        else:
            t = position
        if not 1 <= t < len(ids):
            raise ValueError(f"token #{position} is outside 1..{len(ids) - 1} of this conversation")
        return ids, t

    def _run(self, request: int, fn) -> None:
        try:
            fn()
        except (runtime.AttnchatError, ValueError) as e:
            log.info("insight request failed: %s", e)
            self.failed.emit(request, str(e))
        except Exception as e:  # noqa: BLE001 - one line for the user, traceback to the log
            log.exception("insight request failed")
            self.failed.emit(request, f"the insight view failed ({type(e).__name__}: {e}); see the log for details")

    @Slot(int, int, object, str, int, object, int, int, int)
    def explain(self, request: int, conv_id: int, history: list, system: str, layer: int, head, position: int,
                ig_steps: int, permutations: int) -> None:
        def go():
            model = self._ap._model()
            ids, t = self._target(model, conv_id, history, system, position)
            offset = max(0, t - MAX_EXPLAIN_TOKENS)
            window = ids[offset:t + 1]
            ex = runtime.explain_token(model, window, len(window) - 1, layer, head, ig_steps=ig_steps,
                                       permutations=permutations).to_dict()
            texts = self._ap._tokens(model, window)
            for k in ("attention", "input_x_gradient", "integrated_gradients"):
                ex[k] = np.asarray(ex[k], dtype=np.float32)
            ex["permutation"]["tv"] = np.asarray(ex["permutation"]["tv"], dtype=np.float32)
            ex.update(request=request, conv_id=conv_id, tokens=texts[:-1], token=texts[-1], offset=offset,
                      position=t, total=len(ids))
            self.explain_ready.emit(ex)
        self._run(request, go)

    @Slot(int, int, object, str, object, str, int)
    def knockout(self, request: int, conv_id: int, history: list, system: str, heads: list, mode: str,
                 position: int) -> None:
        def go():
            model = self._ap._model()
            ids, t = self._target(model, conv_id, history, system, position)
            offset = max(0, t - MAX_KNOCKOUT_TOKENS)
            window = ids[offset:t + 1]
            before = runtime.top_and_probs(model, window, len(window) - 1)
            with runtime.ablated(model, [tuple(h) for h in heads], mode):
                after = runtime.top_and_probs(model, window, len(window) - 1)
            texts = runtime.token_strings(model, [i for d in (before, after) for i, _ in d["top"]])
            it = iter(texts)
            for d in (before, after):
                d["top"] = [(next(it), p) for _, p in d["top"]]
            self.knockout_ready.emit({"request": request, "heads": [list(h) for h in heads], "mode": mode,
                                      "position": t, "token": runtime.token_strings(model, [ids[t]])[0],
                                      "before": before, "after": after})
        self._run(request, go)

    @Slot(int, int, str)
    def induction(self, request: int, n_heads: int, mode: str) -> None:
        def go():
            model = self._ap._model()
            atlas = self._ap._atlas.get(str(model.path))
            scores = None
            if atlas is not None:
                scores = runtime.HeadScores(induction=np.asarray(atlas["induction"]).tolist(),
                                            previous_token=np.asarray(atlas["previous_token"]).tolist())
            r = runtime.induction_ablation(model, scores=scores, n_heads=n_heads, mode=mode)
            self.induction_ready.emit({**r.to_dict(), "request": request, "model": model.name})
        self._run(request, go)

    @Slot(int, int)
    def cost(self, request: int, context: int) -> None:
        def go():
            model = self._ap._model()
            r = runtime.attention_step_seconds(model, max(1, context))
            self.cost_ready.emit({**r.to_dict(), "request": request, "model": model.name})
        self._run(request, go)


class InsightClient(QObject):
    """The GUI side: owns an :class:`InsightProbe` on the engine's thread, queues requests.

    Each request method returns its id; the matching ``*_ready`` or :attr:`failed` signal carries it back.
    """

    explain_ready = Signal(object)
    knockout_ready = Signal(object)
    induction_ready = Signal(object)
    cost_ready = Signal(object)
    failed = Signal(int, str)

    _explain = Signal(int, int, object, str, int, object, int, int, int)
    _knockout = Signal(int, int, object, str, object, str, int)
    _induction = Signal(int, int, str)
    _cost = Signal(int, int)

    def __init__(self, attention_client, parent: QObject | None = None):
        super().__init__(parent)
        probe = attention_client.probe
        self.probe = InsightProbe(probe)
        self.probe.moveToThread(probe.thread())
        self._request = 0
        self._explain.connect(self.probe.explain)
        self._knockout.connect(self.probe.knockout)
        self._induction.connect(self.probe.induction)
        self._cost.connect(self.probe.cost)
        for name in ("explain_ready", "knockout_ready", "induction_ready", "cost_ready", "failed"):
            getattr(self.probe, name).connect(getattr(self, name))

    def _next(self) -> int:
        self._request += 1
        return self._request

    def explain(self, conv_id: int, history: list, system: str, layer: int, head, position: int = -1,
                ig_steps: int = 16, permutations: int = 32) -> int:
        """``head``: an index or ``"mean"``; ``position``: a token position (-1: the newest reply token)."""
        r = self._next()
        self._explain.emit(r, conv_id, list(history), system or "", layer, head, position, ig_steps, permutations)
        return r

    def knockout(self, conv_id: int, history: list, system: str, heads: list, mode: str, position: int = -1) -> int:
        r = self._next()
        self._knockout.emit(r, conv_id, list(history), system or "", [list(h) for h in heads], mode, position)
        return r

    def induction(self, n_heads: int = 5, mode: str = "mean") -> int:
        r = self._next()
        self._induction.emit(r, n_heads, mode)
        return r

    def cost(self, context: int) -> int:
        r = self._next()
        self._cost.emit(r, context)
        return r
