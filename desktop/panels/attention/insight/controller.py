"""The Insight tab's wiring: requests from its views to the engine, results back to them.

:func:`install_insight` adds the tab (:class:`desktop.panels.attention.insight.views.InsightTabs`)
to an attention panel and returns the :class:`InsightController` that reads the panel's
layer and head choice, the open conversation and the system prompt, sends requests
through an :class:`desktop.panels.attention.insight.probe.InsightClient` and routes the
answers. Must not import torch or runtime.
"""
from __future__ import annotations

from PySide6.QtCore import QObject, QTimer

from desktop.panels.attention.insight.probe import InsightClient
from desktop.panels.attention.insight.views import InsightTabs, parse_head_list
from desktop.worker import model_key

__all__ = ["InsightController", "install_insight"]


class InsightController(QObject):
    """Owns the Insight tab's requests (see the module docstring)."""

    def __init__(self, panel, tabs: InsightTabs):
        super().__init__(panel)
        self.panel, self.tabs = panel, tabs
        self.client = InsightClient(panel.client, self)
        self._pending: dict[str, int] = {}  # view name -> request id in flight
        self._model_key = ""                # whose results the views show (desktop.worker.model_key)
        c, t = self.client, tabs
        c.explain_ready.connect(lambda d: self._done("explain", d, t.explain.set_result))
        c.explain_started.connect(lambda rid, plan: self._pending.get("explain") == rid and t.explain.set_running(plan))
        c.explain_progress.connect(lambda rid, done, total, work: self._pending.get("explain") == rid
                                   and t.explain.set_progress(done, total, work))
        t.explain.cancel_requested.connect(self.cancel_explain)
        c.explain_planned.connect(lambda rid, plan: rid == self._plan_request and t.explain.set_plan(plan))
        self._plan_request = 0
        self._plan_timer = QTimer(self, singleShot=True, interval=300)   # one request after a burst of changes
        self._plan_timer.timeout.connect(self.plan_explain)
        for spin in (t.explain.position, t.explain.steps, t.explain.perms):
            spin.valueChanged.connect(lambda *_: self._plan_timer.start())
        panel.tabs.currentChanged.connect(lambda *_: self._plan_timer.start())
        panel.main.conversation_stats.connect(lambda *_: self._plan_timer.start())
        c.knockout_ready.connect(lambda d: self._done("knockout", d, t.knockout.set_result))
        c.induction_ready.connect(lambda d: self._done("induction", d, t.knockout.set_preset))
        c.cost_ready.connect(lambda d: self._done("cost", d, t.cost.set_timing))
        c.failed.connect(self._failed)
        t.explain.run_requested.connect(self.explain)
        t.knockout.run_requested.connect(self.knockout)
        t.knockout.preset_requested.connect(self.induction)
        t.knockout.fill_requested.connect(self.fill_induction_heads)
        t.cost.measure_requested.connect(self.cost)
        t.currentChanged.connect(lambda *_: (self.update_context(), self._plan_timer.start()))
        panel.main.model_changed.connect(self.set_model)
        panel.main.reply_finished.connect(lambda *_: (self.update_context(), self._plan_timer.start()))
        self.set_model(panel.main.engine.model)

    # ---- state from the panel and the window -----------------------------------------------
    def set_model(self, info: dict | None) -> None:
        key = model_key(info)
        if key != self._model_key:   # another model: its heads and results are not the old one's
            if self._model_key:
                self._pending.clear()   # answers still coming belong to the old model
                self._hold(False)
                self.tabs.explain.clear()
                self.tabs.knockout.clear()
            self._model_key = key
        self.tabs.cost.set_model(info)
        self.tabs.scale.set_head_dim((info or {}).get("head_dim"))

    def update_context(self) -> None:
        """The open conversation's length (tokens its cache held after the last reply) for the Cost view."""
        conv = self.panel.main.current_conversation
        if conv:
            self.tabs.cost.set_context(len(self.panel.client.probe.last_context(conv)))

    def busy(self, name: str) -> bool:
        return name in self._pending

    def _conversation(self):
        """(conv_id, history, system) of the open conversation, or None (status says why)."""
        main = self.panel.main
        if not main.engine.model or not self.panel.n_layers:
            self.panel.status.setText("Load a model running in this app to use the insight views.")
            return None
        conv = main.current_conversation
        history = [(m.role, m.content) for m in main.store.messages(conv)] if conv else []
        if not history:
            self.panel.status.setText("Open a conversation (or send a message) first.")
            return None
        return conv, history, main.generation().get("system_prompt") or ""

    def _hold(self, on: bool) -> None:
        """Say on the engine that Explain holds its thread (a reply sent now waits for it)."""
        engine = self.panel.main.engine
        if hasattr(engine, "holding"):
            engine.holding = "Explain" if on else ""

    def _sent(self, name: str, rid: int, what: str) -> None:
        self._pending[name] = rid
        if name == "explain":
            self._hold(True)
        busy = " (after the reply in progress)" if self.panel.main.replying else ""
        self.panel.status.setText(f"Computing {what}{busy}…")

    def _done(self, name: str, d: dict, show) -> None:
        if self._pending.get(name) != d.get("request"):
            return  # an older request's answer
        del self._pending[name]
        self.panel.status.setText("")
        if name == "explain":
            self._hold(False)
            self.tabs.explain.set_idle()
            self.schedule_plan()
        show(d)

    def _failed(self, request: int, message: str) -> None:
        for name, rid in list(self._pending.items()):
            if rid == request:
                del self._pending[name]
                self.panel.status.setText(message)
                if name == "explain":
                    self._hold(False)
                    self.tabs.explain.set_idle()
                    self.schedule_plan()

    def cancel_explain(self) -> None:
        """Cancel (the Explain view's button): the running Explain stops before its next batch."""
        rid = self._pending.get("explain")
        if rid is not None:
            self.client.cancel_explain(rid)
            self.tabs.explain.cancelling()
            self.panel.status.setText("Cancelling Explain…")

    # ---- requests ------------------------------------------------------------------------
    def schedule_plan(self) -> None:
        """Ask what Explain would take, after a burst of changes settles (:meth:`plan_explain`)."""
        self._plan_timer.start()

    def plan_explain(self) -> int | None:
        """While the Explain view shows (and none runs), ask what Explain would take: said before it starts."""
        t, main = self.tabs, self.panel.main
        if (t.currentWidget() is not t.explain or self.panel.tabs.currentWidget() is not t or "explain" in self._pending
                or not main.engine.model or not self.panel.n_layers or not self.panel.isVisible()):
            return None
        conv = main.current_conversation
        history = [(m.role, m.content) for m in main.store.messages(conv)] if conv else []
        if not history:   # a new chat: the line said the last conversation's tokens and time
            self._plan_request = 0   # an answer still coming is that conversation's
            t.explain.clear_plan()
            return None
        v = t.explain
        self._plan_request = self.client.plan_explain(conv, history, main.generation().get("system_prompt") or "",
                                                      v.position.value(), v.steps.value(), v.perms.value(),
                                                      v.window.value())
        return self._plan_request

    def explain(self) -> int | None:
        got = self._conversation()
        if got is None:
            return None
        head = self.panel.selected_head
        if head == "max":
            self.panel.status.setText("Explain takes one head or the mean of heads, not the max.")
            return None
        v = self.tabs.explain
        rid = self.client.explain(*got, self.panel.selected_layer, head, v.position.value(), v.steps.value(),
                                  v.perms.value(), v.window.value())
        self._sent("explain", rid, "gradients, integrated gradients and permutations")
        return rid

    def knockout(self) -> int | None:
        got = self._conversation()
        if got is None:
            return None
        v = self.tabs.knockout
        try:
            heads = parse_head_list(v.heads.text(), self.panel.n_layers, self.panel.n_heads)
        except ValueError as e:
            self.panel.status.setText(str(e))
            return None
        rid = self.client.knockout(*got, heads, v.mode.currentData(), v.position.value())
        self._sent("knockout", rid, "the token's probability with and without those heads")
        return rid

    def fill_induction_heads(self) -> None:
        """The 5 best induction heads of the head atlas (measured on the Heads tab) into the field."""
        atlas = self.panel.atlas
        if atlas.scores is None:
            self.panel.status.setText("Measure the heads first (Heads tab), then fill in the top induction heads.")
            return
        self.tabs.knockout.heads.setText(" ".join(f"{l}.{h}" for l, h, _ in atlas.top_heads("induction", 5)))

    def induction(self) -> int | None:
        if not self.panel.main.engine.model or not self.panel.n_layers:
            self.panel.status.setText("Load a model running in this app to run the induction test.")
            return None
        # 5 heads (half the heads at most: a tiny model has fewer)
        rid = self.client.induction(min(5, self.panel.n_layers * self.panel.n_heads // 2), "mean")
        self._sent("induction", rid, "the induction test (repeated random tokens, 5 forwards)")
        return rid

    def cost(self) -> int | None:
        if not self.panel.main.engine.model or not self.panel.n_layers:
            self.panel.status.setText("Load a model running in this app to measure its attention.")
            return None
        self.update_context()
        n = self.tabs.cost.context or 1_000
        rid = self.client.cost(n)
        self._sent("cost", rid, f"our attention's time per decode step at {n:,} tokens")
        return rid


def install_insight(panel) -> InsightController:
    """Add the Insight tab to ``panel`` (an ``AttentionPanel``); the controller."""
    tabs = InsightTabs()
    panel.tabs.addTab(tabs, "Insight")
    return InsightController(panel, tabs)
