"""The attention panel's Formula view: ``softmax(q·k/√d)·v`` for one query token, one
layer and one head, with the numbers of each step (from ``runtime.LayerAttention.explain``,
sent by the engine as a plain dict). The head is the panel's when it has chosen one, else
(the mean or max of heads) this view's own Head box. Numbers of a conversation that has
changed since are marked out of date until recomputed, and cleared when they cannot be.
Must not import torch or runtime.
"""
from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QSpinBox, QTableWidget,
    QTableWidgetItem, QVBoxLayout, QWidget,
)

from desktop.panels.attention.views import quote, rich_label
from desktop.panels.attention.widgets import display_token
from desktop.widgets.fit_rows import whole_columns

__all__ = ["NumbersView"]


class NumbersView(QWidget):
    """``softmax(q·k/√d)·v`` for one query token, one layer and one head, with its numbers."""

    compute_requested = Signal()
    COLUMNS = ("key", "token", "q·k", "÷√d", "exp(z−max)", "weight", "|w·v|")

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.steps: dict | None = None
        self.query = QSpinBox()
        self.query.setRange(-1, 1_000_000)
        self.query.setSpecialValueText("newest")
        self.query.setValue(-1)
        self.query.setToolTip("The query token's position in the conversation (newest: the last one)")
        self.head = QSpinBox()
        self.head.setPrefix("Head ")
        self.head.setRange(0, 0)
        self.head.setToolTip("The head the formula is worked for: the one chosen above, or with the mean or "
                             "max of heads chosen there, this one (q and k belong to one head)")
        self.top = QSpinBox()
        self.top.setRange(1, 50)
        self.top.setValue(5)
        self.compute_button = QPushButton("Compute")
        self.explanation = rich_label("Choose a layer, a head and a query token (or click a row of the snapshot).")
        self.table = QTableWidget(0, len(self.COLUMNS))
        self.table.setHorizontalHeaderLabels(list(self.COLUMNS))
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        # Every column whole, the table scrolling sideways in a narrow dock: the stretched token
        # column was squeezed to "oken" with its tokens cut to "<|i…".
        whole_columns(self.table)
        self.table.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.footer = rich_label("", small=True)
        # Two rows: on one, the controls made the tab (and so the dock) 406 px wide at least.
        row = QHBoxLayout()
        row.addWidget(QLabel("Query"))
        row.addWidget(self.query)
        row.addWidget(self.head)
        row.addStretch(1)
        row2 = QHBoxLayout()
        row2.addWidget(QLabel("Top keys"))
        row2.addWidget(self.top)
        row2.addStretch(1)
        row2.addWidget(self.compute_button)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(row)
        lay.addLayout(row2)
        lay.addWidget(self.explanation)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.footer)
        self.compute_button.clicked.connect(self.compute_requested)

    def set_heads(self, n: int) -> None:
        """The model has ``n`` query heads per layer."""
        self.head.setRange(0, max(n - 1, 0))

    def mark_stale(self) -> None:
        """The conversation changed: the numbers shown (if any) are of one that no longer is."""
        if self.steps is not None and self.table.isEnabled():
            self.table.setEnabled(False)
            self.footer.setText("<b>Out of date:</b> the conversation changed since these numbers were computed; "
                                "they are computed again when this tab is shown (or press Compute).")

    def show_failure(self, message: str) -> None:
        """No numbers for the current choice (``message``: why): nothing old stays on screen."""
        self.steps = None
        self.table.setRowCount(0)
        self.table.setEnabled(True)
        self.explanation.setText(f"No numbers: {message}. Choose another query token, or click a row of the snapshot.")
        self.footer.setText("")

    def set_steps(self, d: dict) -> None:
        self.steps = d
        self.table.setEnabled(True)
        off = d["offset"]
        rt = 1.0 / d["scale"]
        self.explanation.setText(
            f"Query #{off + d['query']} {quote(d['query_token'])} · layer {d['layer']} · head {d['head']} "
            f"(reads KV head {d['kv_head']}) · d = {d['head_dim']}, √d = {rt:.3g}<br>"
            f"1. score every visible key: s = q·k &nbsp;(|q| = {d['query_norm']:.3g}, {d['n_keys']:,} keys)<br>"
            f"2. scale: z = s / √d &nbsp;(max z = {d['max_scaled']:.4g})<br>"
            f"3. softmax: w = exp(z − max z) / Σ exp(z − max z), Σ = {d['denominator']:.4g}<br>"
            f"4. mix: o = Σ w·v over all keys → |o| = {d['output_norm']:.4g}")
        self.table.setRowCount(len(d["keys"]))
        for r, k in enumerate(d["keys"]):
            cells = (f"#{off + k}", display_token(d["tokens"][r]), f"{d['raw'][r]:.3f}", f"{d['scaled'][r]:.3f}",
                     f"{d['exp'][r]:.4f}", f"{d['weights'][r]:.4f}", f"{d['contribution_norms'][r]:.3f}")
            for c, text in enumerate(cells):
                it = QTableWidgetItem(text)
                if c != 1:
                    it.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(r, c, it)
        share = sum(d["weights"])
        self.footer.setText(f"These {len(d['keys'])} keys hold {share:.1%} of the weight; their share of o alone has "
                            f"|Σ w·v| = {d['top_output_norm']:.4g} (all keys: {d['output_norm']:.4g}). "
                            "|w·v| = w × |v|.")

    def data(self) -> dict:
        d = self.steps
        if d is None:
            return {}
        out = {k: np.asarray(d[k]) for k in ("keys", "raw", "scaled", "exp", "weights", "value_norms", "contribution_norms")}
        out["keys"] = out["keys"] + d["offset"]
        out.update({k: d[k] for k in ("layer", "head", "kv_head", "head_dim", "scale", "n_keys", "max_scaled",
                                      "denominator", "query_norm", "output_norm", "top_output_norm")})
        out.update(view="numbers", query=d["query"] + d["offset"], query_token=d["query_token"],
                   tokens=np.array(d["tokens"], dtype=object).astype(str))
        return out
