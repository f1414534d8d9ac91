"""The attention-variant comparison under the memory planner: for the planned model's shape,
the KV cache per token and at the chosen context under multi-head, grouped-query,
multi-query and sliding-window attention.

The figures are runtime's planner's (:attr:`runtime.MemoryPlan.variants`, also printed
by ``attnchat memory``): per token ``2 x layers x KV heads x head dim x bytes per element``
(plus a 4-byte scale per vector for int8), and at the context a sliding layer holds at
most its window. Multi-query attention (Shazeer 2019) keeps one KV head, grouped-query
(Ainslie et al. 2023) a few, multi-head one per query head; a sliding window
(Longformer, Mistral, Gemma) bounds what a layer keeps. Must not import torch.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from desktop.widgets.fit_rows import fit_rows

__all__ = ["VariantsTable", "window_text"]

MIB = 2**20
COLUMNS = ("Attention", "KV heads", "Window", "Per token", "At the context", "× this model")
AT = COLUMNS.index("At the context")


def window_text(v: dict, layers: int | None = None) -> str:
    """A row's window cell: ``"—"`` (every layer full), ``"512 × 18 layers"``, ``"512 × 15 of 18"``."""
    if v["window"] is None:
        return "—"
    if layers is not None and v["windowed_layers"] < layers:
        return f"{v['window']:,} × {v['windowed_layers']} of {layers}"
    return f"{v['window']:,} × {v['windowed_layers']} layers"


def _bytes(n: int) -> str:
    return f"{n:,} B" if n < MIB else f"{n / MIB:,.1f} MiB"


class VariantsTable(QWidget):
    """A caption and one row per variant; the model's own row is bold and named so."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attentionVariants")
        self.caption = QLabel("Attention variants: plan a model to compare them.")
        self.caption.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("variantsTable")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        head = self.table.horizontalHeader()
        head.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for c in range(1, len(COLUMNS)):
            head.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setToolTip("KV-cache bytes this model's layers and head size would take under each kind of "
                              "attention: multi-head keeps one key/value head per query head, grouped-query a few, "
                              "multi-query one; a sliding window keeps only the newest tokens in a layer")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.caption)
        lay.addWidget(self.table)
        self.variants: list[dict] = []
        # Rows follow the first column's width: sized once, before the dialog's layout narrowed
        # that column, "grouped-query (this model)" needed a third line and was cut to "(this …".
        self._fit_rows = fit_rows(self.table, after=self._size_to_rows)

    def set_variants(self, variants: list[dict], *, context: int, cache_dtype: str, layers: int) -> None:
        """Show ``variants`` (:attr:`runtime.MemoryPlan.variants`) of a ``layers``-layer model at ``context`` tokens."""
        self.variants = list(variants)
        mine = next((v for v in variants if v["this_model"]), None)
        self.caption.setText(f"The same layers and head size under each kind of attention, {cache_dtype} cache, "
                             f"at {context:,} tokens:")
        self.table.setHorizontalHeaderItem(AT, QTableWidgetItem(f"At {context:,} tokens"))
        self.table.setRowCount(len(variants))
        bold = QFont(self.font())
        bold.setBold(True)
        for r, v in enumerate(variants):
            ratio = "" if not mine else f"{v['bytes_at_context'] / max(mine['bytes_at_context'], 1):.2f}×"
            name = v["name"] if v["name"] == "this model" or not v["this_model"] else f"{v['name']} (this model)"
            cells = (name, f"{v['kv_heads']}", window_text(v, layers), _bytes(v["bytes_per_token"]),
                     _bytes(v["bytes_at_context"]), ratio)
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if v["this_model"]:
                    item.setFont(bold)
                self.table.setItem(r, c, item)
        self._fit_rows()

    def _size_to_rows(self) -> None:
        """The table as tall as its rows (it does not scroll)."""
        rows = sum(self.table.rowHeight(r) for r in range(self.table.rowCount()))
        self.table.setFixedHeight(self.table.horizontalHeader().height() + rows + 2 * self.table.frameWidth())

    def clear(self, why: str) -> None:
        self.variants = []
        self.table.setRowCount(0)
        self.caption.setText(why)
