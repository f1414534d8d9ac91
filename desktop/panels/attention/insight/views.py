"""The attention panel's Insight tab: tests no other app runs inside a conversation.

- Explain: does attention explain this token? Jain and Wallace 2019's two tests
  (``runtime.explain_token``): the chosen head's weights beside gradient importance
  (input x gradient, integrated gradients), Kendall's tau between them, and the
  permutation counterfactual.
- Knock out: ablate heads (zero or mean), the chosen token's probability and the top 5
  before and after; the induction preset (Olsson et al. 2022).
- By hand: the formula sandbox, predict-then-reveal (:mod:`desktop.panels.attention.sandbox`).
- √d_k: why divide by it (:mod:`desktop.panels.attention.sandbox`).
- Cost: what long context costs in attention scores, and our attention's measured time
  per decode step at the current context.

Each view takes plain data from :class:`desktop.panels.attention.insight.probe.InsightClient`
and returns what it shows from ``data()`` (the panel's .npz export). Must not import torch or runtime.
"""
from __future__ import annotations

import html

import numpy as np
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox, QHBoxLayout, QHeaderView, QLineEdit, QPushButton, QVBoxLayout, QWidget,
)

from desktop.flow_layout import flow_row, labelled
from desktop.panels.attention.insight.explain import ExplainView, _fill, _position_spin, _table
from desktop.panels.attention.sandbox import SandboxView, ScaleView
from desktop.panels.attention.views import quote, rich_label
from desktop.panels.attention.widgets import display_token
from desktop.widgets.fit_rows import fit_rows, whole_columns
from desktop.widgets.wrapping_tabs import WrappingTabs

__all__ = ["CostView", "ExplainView", "InsightTabs", "KnockoutView", "parse_head_list", "scores_table"]


def parse_head_list(text: str, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """``"17.3 18.6"`` -> ``[(17, 3), (18, 6)]`` (layer.head, zero-based; ``L17.H3`` too).

    Raises:
        ValueError: a part that is not layer.head, or a head outside the model.
    """
    out = []
    for part in text.replace(",", " ").split():
        p = part.upper().replace("L", "").replace("H", "")
        layer, dot, head = p.partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise ValueError(f"{part!r} is not a head; write layer.head, e.g. 17.3 (zero-based)")
        l, h = int(layer), int(head)
        if not (l < n_layers and h < n_heads):
            raise ValueError(f"head {part} is outside layers 0..{n_layers - 1} and heads 0..{n_heads - 1}")
        out.append((l, h))
    if not out:
        raise ValueError("type the heads to knock out as layer.head, e.g. 17.3 18.6")
    return sorted(set(out))


class KnockoutView(QWidget):
    """Knock heads out; the induction preset."""

    run_requested = Signal()
    preset_requested = Signal()
    fill_requested = Signal()
    INTRO = "Knock heads out and see the chosen token's probability and the top 5 before and after."

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("knockout")
        self.result: dict | None = None
        self.preset: dict | None = None
        self.heads = QLineEdit()
        self.heads.setPlaceholderText("layer.head, e.g. 17.3 18.6")
        self.fill = QPushButton("Top induction heads")
        self.fill.setToolTip("Fill in the 5 best induction heads of the head atlas (Heads tab)")
        self.mode = QComboBox()
        self.mode.addItem("zero", "zero")
        self.mode.addItem("mean", "mean")
        self.mode.setToolTip("zero: the head's output becomes 0; mean: its mean over the tokens")
        self.position = _position_spin()
        self.run = QPushButton("Knock out")
        self.run_preset = QPushButton("Induction test")
        self.run_preset.setToolTip("Olsson et al. 2022: loss on repeated random tokens with the top 5 induction heads "
                                   "mean-ablated, and with 5 random heads (3 draws)")
        self.summary = rich_label(self.INTRO)
        self.table = _table(("rank", "before", "p", "after", "p"))
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.preset_label = rich_label("", small=True)
        # Headers on two lines and the heads wrapped: in a 240 px panel "heads knocked out" was
        # cut to "…nock" and the heads listed after "top induction:" ran out of their cell.
        self.preset_table = _table(("heads\nknocked out", "loss,\n1st copy", "loss,\n2nd copy"))
        self._fit_preset = fit_rows(self.preset_table)
        self.table.setMaximumHeight(200)  # the top 5: the rest of the height goes to the induction test
        r1 = flow_row(labelled("Heads", self.heads), self.fill)
        r2 = flow_row(self.mode, labelled("Token", self.position), self.run, self.run_preset)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(r1)
        lay.addLayout(r2)
        lay.addWidget(self.summary)
        lay.addWidget(self.table)
        lay.addWidget(self.preset_label)
        lay.addWidget(self.preset_table, 1)
        self.run.clicked.connect(self.run_requested)
        self.run_preset.clicked.connect(self.preset_requested)
        self.fill.clicked.connect(self.fill_requested)

    def clear(self) -> None:
        """Forget the heads typed and every result (another model is loaded: other heads)."""
        self.result = self.preset = None
        self.heads.clear()
        self.table.setRowCount(0)
        self.preset_table.setRowCount(0)
        self.summary.setText(self.INTRO)
        self.preset_label.setText("")

    def set_result(self, r: dict) -> None:
        self.result = r
        b, a = r["before"], r["after"]
        rows = [(i + 1, display_token(b["top"][i][0]), f"{b['top'][i][1]:.3f}", display_token(a["top"][i][0]),
                 f"{a['top'][i][1]:.3f}") for i in range(min(len(b["top"]), len(a["top"])))]
        _fill(self.table, rows, (1, 3))
        heads = " ".join(f"{l}.{h}" for l, h in r["heads"])
        self.summary.setText(
            f"Token #{r['position']} {quote(r['token'])}: p = <b>{b['prob']:.3f}</b> before, "
            f"<b>{a['prob']:.3f}</b> with {heads} {r['mode']}-ablated.")

    def set_preset(self, r: dict) -> None:
        self.preset = r
        rows = [("none", f"{r['baseline_first']:.2f}", f"{r['baseline_second']:.2f}"),
                ("top induction: " + " ".join(f"{l}.{h}" for l, h in r["heads"]), f"{r['induction_first']:.2f}",
                 f"{r['induction_second']:.2f}")]
        for heads, f, s in zip(r["random_heads"], r["random_first"], r["random_second"]):
            rows.append(("random: " + " ".join(f"{l}.{h}" for l, h in heads), f"{f:.2f}", f"{s:.2f}"))
        _fill(self.preset_table, rows)
        self._fit_preset()
        rise = r["induction_second"] - r["baseline_second"]
        rnd = max(r["random_second"]) - r["baseline_second"] if r["random_second"] else float("nan")
        self.preset_label.setText(
            f"Olsson et al.'s test on {html.escape(r.get('model', 'the model'))}: {r['repeat_len']} random tokens "
            f"repeated, {r['batch']} sequences (seed {r['seed']}), {r['mode']}-ablation, loss in nats per token. "
            f"Knocking out {len(r['heads'])} induction heads raises the second copy's loss by <b>{rise:+.2f}</b>; "
            f"as many random heads by at most <b>{rnd:+.2f}</b>.")

    def data(self) -> dict:
        out = {}
        if self.result is not None:
            r = self.result
            out.update(heads=np.asarray(r["heads"]), mode=r["mode"], position=r["position"],
                       prob_before=r["before"]["prob"], prob_after=r["after"]["prob"],
                       top_before=np.asarray([t for t, _ in r["before"]["top"]]),
                       top_before_p=np.asarray([p for _, p in r["before"]["top"]]),
                       top_after=np.asarray([t for t, _ in r["after"]["top"]]),
                       top_after_p=np.asarray([p for _, p in r["after"]["top"]]))
        if self.preset is not None:
            p = self.preset
            out.update(induction_heads=np.asarray(p["heads"]), random_heads=np.asarray(p["random_heads"]),
                       baseline_loss=np.asarray([p["baseline_first"], p["baseline_second"]]),
                       induction_loss=np.asarray([p["induction_first"], p["induction_second"]]),
                       random_loss=np.asarray([p["random_first"], p["random_second"]]).T)
        return out


def scores_table(contexts, n_layers: int, n_heads: int) -> list[dict]:
    """Attention scores per head per layer and for the whole model, at each context length.

    Returns:
        one dict per ``n``: ``prefill`` (``n * n`` per head per layer: every query against
        every key), ``decode`` (``n`` for one new token), and both times ``n_layers * n_heads``.
    """
    out = []
    for n in contexts:
        n = int(n)
        out.append({"n": n, "prefill": n * n, "decode": n, "prefill_model": n * n * n_layers * n_heads,
                    "decode_model": n * n_layers * n_heads})
    return out


def _count(x: float) -> str:
    """``1.52e6`` -> ``"1.52 M"`` (k, M, B, T: thousand, million, billion, trillion)."""
    for div, unit in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " k")):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:,.0f}"


class CostView(QWidget):
    """What long context costs in attention (see the module docstring)."""

    measure_requested = Signal()
    CONTEXTS = (1_000, 10_000, 100_000)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("cost")
        self.shape: dict | None = None   # n_layers, n_heads, n_kv_heads, head_dim, context_limit
        self.context = 0
        self.rows: list[dict] = []
        self.timing: dict | None = None
        self.measure = QPushButton("Measure")
        self.measure.setToolTip("Time our attention for one decode step at the current context (all layers)")
        self.model_label = rich_label("")
        # Short headers, each column whole: "decode step / whole model" was cut to "ecode ste /
        # hole mod" in the dock (about 280 px wide at 1100 px).
        self.table = _table(("tokens", "prefill\n1 head", "decode\n1 head", "prefill\nmodel", "decode\nmodel"))
        whole_columns(self.table)
        self._fit_rows = fit_rows(self.table)
        self.timing_label = rich_label("", small=True)
        row = QHBoxLayout()
        row.addWidget(self.model_label, 1)
        row.addWidget(self.measure)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(row)
        lay.addWidget(rich_label("Attention scores computed (q·k products) at a context of n tokens, for one head "
                                 "of one layer (1 head) and for the whole model (layers × heads): every query "
                                 "against every key it sees, so a prefill of n tokens grows with n², one decode "
                                 "step with n. k, M, B, T: thousand, million, billion, trillion.", small=True))
        lay.addWidget(self.table, 1)
        lay.addWidget(self.timing_label)
        self.measure.clicked.connect(self.measure_requested)

    def set_model(self, info: dict | None) -> None:
        if not info or not info.get("n_layers"):
            self.shape = None
            self.model_label.setText("Load a model running in this app.")
            return
        self.shape = {k: int(info.get(k) or 0) for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "context_limit")}
        self.refresh()

    def set_context(self, n: int) -> None:
        """The open conversation's length in tokens (a row of its own)."""
        self.context = int(n)
        self.refresh()

    def refresh(self) -> None:
        if self.shape is None:
            return
        s = self.shape
        ns = sorted(set(self.CONTEXTS) | ({self.context} if self.context else set()))
        self.rows = scores_table(ns, s["n_layers"], s["n_heads"])
        _fill(self.table, [(f"{r['n']:,}" + ("\n(now)" if r["n"] == self.context else ""), _count(r["prefill"]),
                            _count(r["decode"]), _count(r["prefill_model"]), _count(r["decode_model"]))
                           for r in self.rows])
        self._fit_rows()
        self.model_label.setText(f"This model: {s['n_layers']} layers × {s['n_heads']} query heads "
                                 f"({s['n_kv_heads']} KV heads, head size {s['head_dim']}), "
                                 f"context up to {s['context_limit']:,} tokens.")
        self._show_timing()

    def set_timing(self, t: dict) -> None:
        self.timing = t
        self._show_timing()

    def _show_timing(self) -> None:
        t = self.timing
        if t is None:
            self.timing_label.setText("Measure times our attention for one decode step at the current context.")
            return
        per_score = t["seconds"] / max(1, t["context"] * t["n_layers"] * t["n_heads"])
        self.timing_label.setText(
            f"Measured: our attention takes <b>{t['seconds'] * 1e3:.2f} ms</b> per decode step at {t['context']:,} "
            f"tokens of context ({t['per_layer_seconds'] * 1e6:.0f} µs per layer, {t['n_layers']} layers, "
            f"{t['device']}, {t['dtype']}, median of {t['repeats']}): {per_score * 1e9:.2f} ns per score. "
            f"Attention only: the projections and the MLP cost the same at any context.")

    def data(self) -> dict:
        if not self.rows:
            return {}
        out = {k: np.asarray([r[k] for r in self.rows], dtype=np.float64)
               for k in ("n", "prefill", "decode", "prefill_model", "decode_model")}
        out.update({k: v for k, v in (self.shape or {}).items()})
        if self.timing is not None:
            out.update(measured_context=self.timing["context"], measured_seconds=self.timing["seconds"])
        return out


class InsightTabs(WrappingTabs):
    """The Insight tab: the five views above as tabs of their own."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.explain, self.knockout, self.sandbox = ExplainView(), KnockoutView(), SandboxView()
        self.scale, self.cost = ScaleView(), CostView()
        for view, title in ((self.explain, "Explain"), (self.knockout, "Knock out"), (self.sandbox, "By hand"),
                            (self.scale, "Why √d"), (self.cost, "Cost")):
            self.addTab(view, title)

    def view_name(self) -> str:
        return self.currentWidget().objectName()

    def data(self) -> dict:
        d = self.currentWidget().data()
        return {"view": f"insight-{self.view_name()}", **d} if d else {}
