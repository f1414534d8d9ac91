"""The Insight tab's Explain view: does attention explain a token? Attention beside gradient
importance (input x gradient, integrated gradients), Kendall's tau, the permutation test
(``runtime.explain_token``, Jain and Wallace 2019); while it runs, what it will take, its
progress and Cancel. Also the small table and spin-box helpers the Insight views share.

Takes plain data from :class:`desktop.panels.attention.insight.probe.InsightClient`. Must not
import torch or runtime.
"""
from __future__ import annotations

import html

import numpy as np
from PySide6.QtCore import QElapsedTimer, Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView, QFrame, QHeaderView, QProgressBar, QPushButton, QScrollArea, QSpinBox, QTableWidget,
    QTableWidgetItem, QVBoxLayout, QWidget,
)

from desktop.flow_layout import flow_row, labelled
from desktop.panels.attention.views import quote, rich_label
from desktop.panels.attention.widgets import display_token

__all__ = ["ExplainView"]


def _table(columns) -> QTableWidget:
    t = QTableWidget(0, len(columns))
    t.setHorizontalHeaderLabels(list(columns))
    t.verticalHeader().setVisible(False)
    t.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    t.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
    return t


def _fill(table: QTableWidget, rows: list[tuple], text_columns: tuple[int, ...] = (0,)) -> None:
    """Numbers right-aligned, the ``text_columns`` left-aligned."""
    table.setRowCount(len(rows))
    for i, row in enumerate(rows):
        for c, text in enumerate(row):
            item = QTableWidgetItem(str(text))
            if c not in text_columns:
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            table.setItem(i, c, item)


def _position_spin() -> QSpinBox:
    s = QSpinBox()
    s.setRange(-1, 1_000_000)
    s.setSpecialValueText("newest reply token")
    s.setValue(-1)
    s.setToolTip("The token's position in the conversation (newest: the last token of the last reply)")
    return s


def _duration(seconds: float) -> str:
    """``"45 s"``, ``"2 min 10 s"``."""
    s = max(0, round(seconds))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s"


def _mib(n) -> str:
    n = float(n or 0) / 2**20
    return f"{n / 1024:.1f} GiB" if n >= 1024 else f"{n:,.0f} MiB"


def _positions(r: dict) -> list[int]:
    """Each context token's position in the conversation (not consecutive after the KV cache
    dropped tokens)."""
    return list(r.get("positions") or range(r["offset"], r["offset"] + len(r["tokens"])))


def _dropped(r: dict) -> str:
    """Said when the KV cache no longer held some of the context (rolling, truncate-middle)."""
    n = int(r.get("dropped") or 0)
    if not n:
        return ""
    return (f" (as the KV cache held them: {n:,} earlier token{'s' if n != 1 else ''} had been dropped, "
            f"so the model did not see {'them' if n != 1 else 'it'})")


class ExplainView(QWidget):
    """Attention beside gradient importance for one token, Kendall's tau, the permutation test;
    while it runs, what it will take, its progress and Cancel."""

    run_requested = Signal()
    cancel_requested = Signal()
    # Short headers (each explained by its tooltip): the view's scroll bar and the table's leave a
    # 265 px panel about 230 px, and longer ones squeezed the token column to "#...".
    COLUMNS = ("token", "attn", "in × grad", "IG")
    COLUMN_TIPS = ("The context token (#position and text)", "Attention weight of the chosen head (or the mean) "
                   "at the query that predicts the token", "Input × gradient (nats)",
                   "Integrated gradients (nats; 0 for tokens that did not move)")
    TABLE_ROWS = 7
    INTRO = ("Choose a layer and a head (or the mean), then Explain: is the newest reply token "
             "explained by where that head looks? (Jain and Wallace 2019)")

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("explain")
        self.setFocusPolicy(Qt.FocusPolicy.ClickFocus)   # it takes the focus from Cancel (see cancelling)
        self.result: dict | None = None
        self.position = _position_spin()
        # The defaults are runtime.IG_STEPS and runtime.IG_POSITIONS (a test holds them equal):
        # on the default model they keep the integration error inside the 10 % said below.
        self.steps = QSpinBox()
        self.steps.setRange(3, 512)
        self.steps.setValue(97)
        self.steps.setPrefix("IG steps ≤ ")
        self.steps.setToolTip("Integrated gradients: the most passes along the path (a forward and a backward each). "
                              "It stops sooner once the integration error it measures is within 5 % of the change "
                              "in log p (points go where log p turns)")
        self.window = QSpinBox()
        self.window.setRange(2, 4096)
        self.window.setValue(64)
        self.window.setPrefix("over the last ")
        self.window.setSuffix(" tokens")
        self.window.setToolTip("Integrated gradients move only these context tokens from the baseline (the others keep "
                               "their embeddings and are computed once): fewer make a smoother path and cheaper steps")
        self.perms = QSpinBox()
        self.perms.setRange(1, 512)
        self.perms.setValue(32)
        self.perms.setPrefix("permutations ")
        self.run = QPushButton("Explain")
        self.cancel = QPushButton("Cancel")
        self.cancel.hide()
        self.progress = QProgressBar()
        self.progress.setObjectName("explainProgress")
        self.progress.hide()
        self.estimate = rich_label("", small=True)   # what a run takes: said before it starts, and while it runs
        self.estimate.setObjectName("explainEstimate")
        self.estimate.hide()
        self._plan: dict = {}
        self._running = False
        self.summary = rich_label(self.INTRO)
        self.table = _table(self.COLUMNS)
        for c, tip in enumerate(self.COLUMN_TIPS):
            self.table.horizontalHeaderItem(c).setToolTip(tip)
        self.sentence = rich_label("", small=True)
        row = flow_row(labelled("Token", self.position), self.steps, self.window, self.perms, self.run, self.cancel)
        # A result's texts took the height at 720 px (two table rows showed): the table keeps
        # TABLE_ROWS rows and the view scrolls instead.
        t = self.table
        t.setMinimumHeight(t.horizontalHeader().sizeHint().height() + self.TABLE_ROWS * t.verticalHeader().defaultSectionSize()
                           + 2 * t.frameWidth() + 8)
        body = QWidget()
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        lay = QVBoxLayout(body)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(row)
        lay.addWidget(self.progress)
        lay.addWidget(self.estimate)
        lay.addWidget(self.summary)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.sentence)
        self.scroll.setWidget(body)
        self.run.clicked.connect(self.run_requested)
        self.cancel.clicked.connect(self.cancel_requested)
        self._expected = 0.0   # seconds the running Explain was expected to take
        self._clock = QElapsedTimer()

    def set_plan(self, plan: dict) -> None:
        """What Explain would take with the current choices (``tokens``, ``passes``, ``seconds``,
        ``peak_bytes``), said before it starts; ignored while one runs."""
        if self._running:
            return
        self._plan = dict(plan)
        self._expected = float(plan.get("seconds") or 0.0)
        most = float(plan.get("most_seconds") or self._expected)
        self.estimate.setText(
            f"Explain of {int(plan.get('tokens', 0)):,} context tokens: about {_duration(self._expected)} "
            f"(at most {_duration(most)}) and {_mib(plan.get('peak_bytes'))} of memory at most for the gradients "
            f"({plan.get('basis', 'this machine, measured')}). Cancel stops it between passes.")
        self.estimate.show()

    def clear_plan(self) -> None:
        """No conversation to explain: no estimate (ignored while one runs)."""
        if self._running:
            return
        self._plan = {}
        self.estimate.setText("")
        self.estimate.hide()

    def set_running(self, plan: dict) -> None:
        """A run started: what it will take (``tokens``, ``passes``, ``seconds``, ``peak_bytes``),
        a progress bar, and Cancel."""
        self._expected = float(plan.get("seconds") or 0.0)
        self._plan = dict(plan)
        self._clock.start()
        self.progress.setRange(0, max(1, int(plan.get("passes") or 1)))
        self.progress.setValue(0)
        self.progress.setFormat("%v of %m passes")
        for w in (self.progress, self.estimate, self.cancel):
            w.show()
        self.cancel.setEnabled(True)
        self.run.setEnabled(False)
        self._running = True
        self._say(None)

    def cancelling(self) -> None:
        """Cancel was clicked: the button greys out until the run stops. The focus goes to the
        view itself first: left on the disabled button it moved to the next widget down, and the
        scroll area scrolled to that one (the view jumped under the pointer)."""
        self.setFocus(Qt.FocusReason.OtherFocusReason)
        self.cancel.setEnabled(False)

    def set_progress(self, done: int, total: int, work: float | None = None) -> None:
        """``done`` of ``total`` passes; ``work``: the share of the work done (0..1; a gradient
        pass costs more than a forward), for the time left."""
        self.progress.setRange(0, max(1, total))
        self.progress.setValue(done)
        self._say(work if work is not None else (done / total if total else None))

    def set_idle(self) -> None:
        """The run ended (its result, a failure, or cancelled)."""
        if self.cancel.hasFocus():   # hidden, it would hand the focus down the view (see cancelling)
            self.setFocus(Qt.FocusReason.OtherFocusReason)
        for w in (self.progress, self.estimate, self.cancel):
            w.hide()
        self.run.setEnabled(True)
        self._running = False

    def _say(self, fraction: float | None) -> None:
        p = self._plan
        text = (f"Explaining {int(p.get('tokens', 0)):,} context tokens: about {_duration(self._expected)} "
                f"and {_mib(p.get('peak_bytes'))} of memory at most for the gradients.")
        if fraction:
            spent = self._clock.elapsed() / 1000
            left = spent / fraction - spent
            text += f" About {_duration(left)} left." if left >= 1 else " Almost done."
        self.estimate.setText(text)

    def set_result(self, r: dict) -> None:
        self.result = r
        att, ixg, ig = (np.asarray(r[k], dtype=np.float32) for k in ("attention", "input_x_gradient", "integrated_gradients"))
        order = np.argsort(-att)  # heaviest attention first
        pos = _positions(r)
        rows = [(f"#{pos[j]} {display_token(r['tokens'][j])}", f"{att[j]:.3f}", f"{ixg[j]:+.3f}", f"{ig[j]:+.3f}")
                for j in order]
        _fill(self.table, rows)
        p = r["permutation"]
        head = "mean of heads" if r["head"] == "mean" else f"head {r['head']}"
        change = r.get("ig_change") or float(np.sum(ig)) - r["ig_gap"]  # log p(token) - log p(token | baseline)
        rough = abs(r["ig_gap"]) > 0.1 * max(1.0, abs(change))
        self.summary.setText(
            f"Token #{r['position']} {quote(r['token'])} "
            f"(log p = {r['log_prob']:.2f}), layer {r['layer']}, {head}, {len(att)} context tokens"
            f"{_dropped(r)}. "
            f"Kendall's τ of attention against |importance|: <b>{r['tau_integrated_gradients']:+.2f}</b> "
            f"(integrated gradients over the last {r.get('ig_positions', len(att))} tokens, {r['ig_steps']} passes; "
            f"integration error {r['ig_gap']:+.2f} of {change:+.2f}"
            f"{': too large, raise the steps or take fewer tokens' if rough else ''}), "
            f"<b>{r['tau_input_x_gradient']:+.2f}</b> (input × gradient). "
            f"Permuting the weights {p['n']} times (seed {p['seed']}): median total variation "
            f"<b>{p['median_tv']:.3f}</b>, top token changed in <b>{p['top_changed']:.0%}</b>.")
        self.sentence.setText(html.escape(r["sentence"]))

    def clear(self) -> None:
        """Forget the result (another model is loaded: its tokens and heads are not these)."""
        self.result = None
        self.table.setRowCount(0)
        self.summary.setText(self.INTRO)
        self.sentence.setText("")
        self.set_idle()
        self.estimate.setText("")
        self._plan = {}

    def data(self) -> dict:
        r = self.result
        if r is None:
            return {}
        p = r["permutation"]
        return {"attention": r["attention"], "input_x_gradient": r["input_x_gradient"],
                "integrated_gradients": r["integrated_gradients"], "tokens": np.asarray(r["tokens"]),
                "positions": np.asarray(_positions(r)), "position": r["position"],
                "layer": r["layer"], "head": str(r["head"]), "tau_input_x_gradient": r["tau_input_x_gradient"],
                "tau_integrated_gradients": r["tau_integrated_gradients"], "ig_steps": r["ig_steps"],
                "ig_gap": r["ig_gap"], "permutation_tv": p["tv"], "median_tv": p["median_tv"],
                "top_changed": p["top_changed"], "seed": p["seed"]}
