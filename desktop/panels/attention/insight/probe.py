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

import time

import numpy as np
from PySide6.QtCore import QObject, Signal, Slot

import runtime
from desktop.panels.attention.probe import run_reported

__all__ = ["InsightClient", "InsightProbe", "MAX_EXPLAIN_TOKENS", "MAX_KNOCKOUT_TOKENS"]


#: Explain looks at most this many context tokens before the chosen token (the last ones):
#: integrated gradients run a forward and a backward per step over all of them.
MAX_EXPLAIN_TOKENS = 512
#: Knock-out runs two forwards over at most this many tokens before the chosen one.
MAX_KNOCKOUT_TOKENS = 4096


class InsightProbe(QObject):
    """The engine-thread half (see the module docstring).

    Signals (every result dict carries its ``request`` id):
        explain_ready: ``runtime.Explanation`` as a dict, plus ``tokens`` (the context's
            texts), ``token`` (the chosen token's text), ``positions`` (each context token's
            position in the conversation; ``offset``: the first), ``dropped`` (tokens before
            the chosen one the KV cache no longer held, so the model did not see them).
        knockout_ready: ``{"heads", "mode", "position", "token", "before", "after"}``;
            ``before``/``after``: ``{"prob", "top": [(text, prob)]}``.
        induction_ready: ``runtime.InductionAblation`` as a dict.
        cost_ready: ``runtime.AttentionStepTime`` as a dict.
        failed: ``(request, one line)``.
    """

    explain_ready = Signal(object)
    explain_started = Signal(int, object)     # request, {"tokens", "passes", "seconds", "peak_bytes"}
    explain_progress = Signal(int, int, int, float)  # request, passes done, passes in all, share of the work done
    explain_planned = Signal(int, object)     # request, the same plan, before any run (what Explain would take)
    knockout_ready = Signal(object)
    induction_ready = Signal(object)
    cost_ready = Signal(object)
    failed = Signal(int, str)

    def __init__(self, attention_probe):
        super().__init__()
        self._ap = attention_probe
        #: Explain requests up to this id are cancelled: set from the GUI thread
        #: (:meth:`InsightClient.cancel_explain`); a running one stops before its next batch of passes.
        self.cancel_upto = 0
        self._seconds_per_token: dict[str, float] = {}   # model path -> seconds per token pass (measured)
        self._timed_by_forward: set[str] = set()   # model paths whose rate is one gradient pass's, not a run's
        self._timed_tokens: dict[str, int] = {}   # model path -> the context length its rate was timed at

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

    def _window(self, model, conv_id: int, history: list, system: str, position: int):
        """What Explain reads for the chosen token: ``(window, t, positions, dropped)``: the
        context's ids then the token's (``window``), the token's position in the conversation,
        each context token's position, and how many tokens before it the KV cache had dropped
        (rolling, truncate-middle: the model never saw them, so neither does Explain; the context
        is also cut to the last :data:`MAX_EXPLAIN_TOKENS`)."""
        ids, t = self._target(model, conv_id, history, system, position)
        held = self._ap.held_ids(conv_id, model)
        positions = runtime.held_context(ids, held, t) if held else None
        dropped = 0 if positions is None else t - len(positions)
        positions = (positions if positions is not None else list(range(t)))[-MAX_EXPLAIN_TOKENS:]
        return [ids[p] for p in positions] + [ids[t]], t, positions, dropped

    def _run(self, request: int, fn) -> None:
        run_reported(fn, request, self.failed, "the insight view")

    def _plan(self, model, window: list[int], ig_steps: int, permutations: int, ig_positions: int) -> dict:
        """What Explain will take for the token ending ``window``: ``tokens``, ``passes``,
        ``token_passes``, ``peak_bytes``, ``seconds`` (typical) and ``most_seconds`` (token passes x this
        machine's seconds per forwarded token: measured by the last run, else by one input x gradient
        pass now, :func:`runtime.explain_rate`, ~15 % of the work) and ``basis`` (which of the two)."""
        n = len(window) - 1
        cost = runtime.explain_cost(model, n, ig_steps=ig_steps, permutations=permutations, ig_positions=ig_positions)
        key = str(model.path)
        basis = "this machine: measured by the last Explain"
        timed = self._timed_tokens.get(key, 0)
        if key not in self._seconds_per_token or not timed / 2 <= n <= 2 * timed:
            # Timed from a gradient pass, the kind most of the time goes to (a forward through
            # the quantized kernels said too little: runtime.explain_rate). Again for a context
            # far from the one timed: a pass's fixed cost spread over 82 tokens made a short
            # chat's estimate longer than a 486-token one's, and a long chat's too short after it.
            self._seconds_per_token[key] = runtime.explain_rate(model, window, n)
            self._timed_by_forward.add(key)
            self._timed_tokens[key] = n
        if key in self._timed_by_forward:
            basis = "this machine: one gradient pass timed now"
        rate = self._seconds_per_token[key]
        return {"tokens": n, "passes": cost["passes"], "token_passes": cost["token_passes"], "basis": basis,
                "peak_bytes": cost["peak_bytes"], "seconds": cost["typical_token_passes"] * rate,
                "most_seconds": cost["token_passes"] * rate}

    @Slot(int, int, object, str, int, int, int, int)
    def plan_explain(self, request: int, conv_id: int, history: list, system: str, position: int, ig_steps: int,
                     permutations: int, ig_positions: int) -> None:
        """What an Explain of this token would take, said before it starts (:attr:`explain_planned`)."""
        def go():
            model = self._ap._model()
            window = self._window(model, conv_id, history, system, position)[0]
            self.explain_planned.emit(request, self._plan(model, window, ig_steps, permutations, ig_positions))
        self._run(request, go)

    @Slot(int, int, object, str, int, object, int, int, int, int)
    def explain(self, request: int, conv_id: int, history: list, system: str, layer: int, head, position: int,
                ig_steps: int, permutations: int, ig_positions: int) -> None:
        def go():
            if self.cancel_upto >= request:
                raise runtime.ExplainCancelled("cancelled before it started")
            model = self._ap._model()
            window, t, positions, dropped = self._window(model, conv_id, history, system, position)
            n = len(window) - 1
            plan = self._plan(model, window, ig_steps, permutations, ig_positions)
            self.explain_started.emit(request, plan)
            key = str(model.path)
            last = [0.0]
            share = _work_share(n, ig_steps, permutations, ig_positions)

            def progress(done: int, total: int) -> None:
                now = time.perf_counter()
                if done == total or now - last[0] >= 0.2:
                    last[0] = now
                    self.explain_progress.emit(request, done, total, share(done))

            t0 = time.perf_counter()
            ex = runtime.explain_token(model, window, n, layer, head, ig_steps=ig_steps, permutations=permutations,
                                       ig_positions=ig_positions or None, progress=progress,
                                       cancelled=lambda: self.cancel_upto >= request).to_dict()
            done = runtime.explain_cost(model, n, ig_steps=ex["ig_steps"], permutations=permutations,
                                        ig_positions=ig_positions)   # the work the run did (steps it took)
            self._seconds_per_token[key] = (time.perf_counter() - t0) / max(1, done["token_passes"])
            self._timed_by_forward.discard(key)
            self._timed_tokens[key] = n
            texts = self._ap._tokens(model, window)
            for k in ("attention", "input_x_gradient", "integrated_gradients"):
                ex[k] = np.asarray(ex[k], dtype=np.float32)
            ex["permutation"]["tv"] = np.asarray(ex["permutation"]["tv"], dtype=np.float32)
            ex.update(request=request, conv_id=conv_id, tokens=texts[:-1], token=texts[-1], offset=positions[0],
                      positions=positions, dropped=dropped, position=t)
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


def _work_share(tokens: int, steps: int, permutations: int, positions: int):
    """``done passes -> share of the work done`` (0..1) for the time left: the input x gradient
    pass, then the integrated-gradient steps, then the permutations, each weighed by
    :func:`runtime.explain_work` (the adaptive rule's unused steps are skipped at once)."""
    first, step, perm = runtime.explain_work(tokens, permutations=permutations, ig_positions=positions or None)
    total = first + steps * step + permutations * perm

    def share(done: int) -> float:
        work = min(done, 1) * first + min(max(done - 1, 0), steps) * step + max(done - 1 - steps, 0) * perm
        return min(1.0, work / total)
    return share


class InsightClient(QObject):
    """The GUI side: owns an :class:`InsightProbe` on the engine's thread, queues requests.

    Each request method returns its id; the matching ``*_ready`` or :attr:`failed` signal carries it back.
    """

    explain_ready = Signal(object)
    explain_started = Signal(int, object)
    explain_progress = Signal(int, int, int, float)
    explain_planned = Signal(int, object)
    knockout_ready = Signal(object)
    induction_ready = Signal(object)
    cost_ready = Signal(object)
    failed = Signal(int, str)

    _explain = Signal(int, int, object, str, int, object, int, int, int, int)
    _plan_explain = Signal(int, int, object, str, int, int, int, int)
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
        self._plan_explain.connect(self.probe.plan_explain)
        self._knockout.connect(self.probe.knockout)
        self._induction.connect(self.probe.induction)
        self._cost.connect(self.probe.cost)
        for name in ("explain_ready", "explain_started", "explain_progress", "explain_planned", "knockout_ready", "induction_ready",
                     "cost_ready", "failed"):
            getattr(self.probe, name).connect(getattr(self, name))
        # Quit, or another model (whose load waits behind the thread's work, and which clears
        # the result): a running Explain stops at its next batch of passes.
        engine = getattr(attention_client, "engine", None)
        if hasattr(engine, "stopping") and hasattr(engine, "load_started"):
            engine.stopping.connect(lambda: self.cancel_explain(self._request))
            engine.load_started.connect(lambda _source: self.cancel_explain(self._request))

    def _next(self) -> int:
        self._request += 1
        return self._request

    def explain(self, conv_id: int, history: list, system: str, layer: int, head, position: int = -1,
                ig_steps: int = runtime.IG_STEPS, permutations: int = 32,
                ig_positions: int = runtime.IG_POSITIONS or 0) -> int:
        """``head``: an index or ``"mean"``; ``position``: a token position (-1: the newest reply token);
        ``ig_positions``: the context tokens integrated gradients move (0: all)."""
        r = self._next()
        self._explain.emit(r, conv_id, list(history), system or "", layer, head, position, ig_steps, permutations,
                           ig_positions)
        return r

    def plan_explain(self, conv_id: int, history: list, system: str, position: int = -1,
                     ig_steps: int = runtime.IG_STEPS, permutations: int = 32,
                     ig_positions: int = runtime.IG_POSITIONS or 0) -> int:
        """Ask what :meth:`explain` would take (:attr:`explain_planned`; nothing is run but,
        once per model, one forward to time this machine)."""
        r = self._next()
        self._plan_explain.emit(r, conv_id, list(history), system or "", position, ig_steps, permutations, ig_positions)
        return r

    def cancel_explain(self, request: int) -> None:
        """Cancel Explain ``request`` (and earlier ones): a running one stops before its next
        batch of passes, a queued one does not start; it answers :attr:`failed` with
        "Explain cancelled." (thread-safe: one int written)."""
        self.probe.cancel_upto = max(self.probe.cancel_upto, request)

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
