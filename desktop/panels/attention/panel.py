"""The attention panel: where the model looks, built on the runtime's own attention.

A dock (View > Attention, closed by default) with one layer and head choice shared by
five tabs:

- Live: as a reply streams, the newest token's attention over the context, for every
  head of the layer, the chosen head (or the mean or max over heads) as a strip and
  shaded over the tokens, and the entropy of each head.
- Snapshot: the chosen layer's and head's full token-by-token matrix for the open
  conversation, as one image (max-pooled to the pixels); hover for query, key and
  weight; leave out the first token, re-normalise rows.
- Heads: every head's previous-token and induction score (Olsson et al. 2022); click
  one to choose it.
- Formula: ``softmax(q·k/√d)·v`` for one query token and one head (with the mean or max
  of heads chosen, the tab's own Head box), with its numbers.
- Insight (:mod:`desktop.panels.attention.insight`): does attention explain a token,
  knock heads out, the formula by hand, why divide by √d_k, what long context costs.

Capture costs only while the Live tab is on screen: the panel tells the engine when it
is (``AttentionClient.set_active``), and otherwise the decoder's ``observer`` stays
``None``. Snapshot, atlas and formula are computed on request, between replies.
Export writes the current view as PNG and its data as .npz. Must not import torch or runtime.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import (
    QComboBox, QLabel, QSpinBox, QToolButton, QVBoxLayout, QWidget,
)

from desktop.file_dialogs import save_file_name
from desktop.flow_layout import flow_row
from desktop.widgets.wrapping_tabs import WrappingTabs
from desktop.panels.attention.formula import NumbersView
from desktop.panels.attention.insight.controller import install_insight
from desktop.panels.attention.probe import AttentionClient
from desktop.panels.attention.views import AtlasView, LiveView, SnapshotView

__all__ = ["AttentionPanel", "install_attention_panel", "PANEL_NAME"]

PANEL_NAME = "attentionPanel"
LIVE, SNAPSHOT, ATLAS, NUMBERS, INSIGHT = range(5)


class AttentionPanel(QWidget):
    """The panel's widget (docked by :func:`install_attention_panel`).

    Args:
        client: the engine side (:class:`desktop.panels.attention.probe.AttentionClient`).
        window: the ``MainWindow`` (its open conversation, database and settings are read),
            kept as :attr:`main` (``window`` is QWidget's own method).
    """

    def __init__(self, client: AttentionClient, window, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("attentionPanelWidget")
        self.client, self.main = client, window
        self.n_layers, self.n_heads = 0, 0
        self._context = 0                  # bumped when the open conversation's tokens may have changed
        self._pending: dict[int, int] = {}  # view -> request id in flight
        self._done: dict[int, tuple] = {}  # view -> the key of what it shows
        self._asked: dict[int, tuple] = {}  # view -> the key last asked for
        self._on_screen = True             # False while the dock is closed or behind another tab
        self.layer = QSpinBox()
        self.layer.setPrefix("Layer ")
        self.head = QComboBox()
        # Its items come with the model: sized once at first show, an empty box stayed "Mean of hea".
        self.head.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.export_png_button = QToolButton()
        self.export_png_button.setText("PNG…")
        self.export_png_button.setToolTip("Export the current view as a PNG image")
        self.export_npz_button = QToolButton()
        self.export_npz_button.setText("Data…")
        self.export_npz_button.setToolTip("Export the current view's numbers as a NumPy .npz file")
        self.live, self.snapshot, self.atlas, self.numbers = LiveView(), SnapshotView(), AtlasView(), NumbersView()
        self.tabs = WrappingTabs()   # every tab in sight at a narrow dock (no scroll arrows)
        for view, title in ((self.live, "Live"), (self.snapshot, "Snapshot"), (self.atlas, "Heads"),
                            (self.numbers, "Formula")):
            self.tabs.addTab(view, title)
        self.insight = install_insight(self)  # the Insight tab (explain, knock out, by hand, √d_k, cost)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        # A row that wraps: one fixed row made the dock (and so the space it takes from the chat) wider.
        top = flow_row(self.layer, self.head, self.export_png_button, self.export_npz_button,
                       stretch={self.head: 1})
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.tabs, 1)
        lay.addWidget(self.status)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(120)
        self._timer.timeout.connect(self._request_current)
        self._connect()
        self.set_model(window.engine.model)

    def _connect(self) -> None:
        c, w = self.client, self.main
        c.live.connect(self._on_live)
        c.snapshot_ready.connect(self._on_snapshot)
        c.atlas_ready.connect(self._on_atlas)
        c.numbers_ready.connect(self._on_numbers)
        c.failed.connect(self._on_failed)
        self.layer.valueChanged.connect(self._selection_changed)
        self.head.currentIndexChanged.connect(self._selection_changed)
        self.tabs.currentChanged.connect(self._tab_changed)
        self.live.head_clicked.connect(self.select_head)
        self.atlas.head_clicked.connect(lambda l, h: self.select(l, h))
        self.atlas.measure_requested.connect(lambda: self.request(ATLAS, force=True))
        self.snapshot.refresh_requested.connect(lambda: self.request(SNAPSHOT, force=True))
        self.snapshot.query_clicked.connect(self._explain_query)
        self.numbers.compute_requested.connect(lambda: self.request(NUMBERS, force=True))
        self.numbers.query.valueChanged.connect(self._schedule)
        self.numbers.head.valueChanged.connect(self._formula_head_changed)
        self.numbers.top.valueChanged.connect(self._schedule)
        self.export_png_button.clicked.connect(self._export_png_dialog)
        self.export_npz_button.clicked.connect(self._export_npz_dialog)
        w.model_changed.connect(self.set_model)
        w.reply_finished.connect(self.context_changed)
        w.sidebar.selected.connect(lambda *_: QTimer.singleShot(0, self.context_changed))

    # ---- selection ---------------------------------------------------------------------
    def set_model(self, info: dict | None) -> None:
        """A model was loaded: size the layer and head choices."""
        if not info:
            return
        if not info.get("n_layers") or not info.get("n_heads"):  # a model on a server: no attention to show
            self.status.setText("The attention view needs a model running in this app, not on a server.")
            return
        self.n_layers, self.n_heads = int(info["n_layers"]), int(info["n_heads"])
        self.numbers.set_heads(self.n_heads)
        self.status.setText("")
        self.layer.blockSignals(True)
        self.head.blockSignals(True)
        self.layer.setRange(0, max(self.n_layers - 1, 0))
        self.layer.setSuffix(f" of {self.n_layers}")
        keep = self.head.currentData()
        self.head.clear()
        self.head.addItem("Mean of heads", "mean")
        self.head.addItem("Max of heads", "max")
        for h in range(self.n_heads):
            self.head.addItem(f"Head {h}", h)
        i = self.head.findData(keep)
        self.head.setCurrentIndex(max(i, 0))
        self.layer.blockSignals(False)
        self.head.blockSignals(False)
        # The old model's head maps stayed on the Heads tab, captioned with its name, until the
        # new model's were measured.
        self.atlas.clear()
        self._done.clear()
        self.context_changed()

    @property
    def selected_layer(self) -> int:
        return self.layer.value()

    @property
    def selected_head(self):
        """A head index, ``"mean"`` or ``"max"``."""
        return self.head.currentData() if self.head.count() else "mean"

    def select(self, layer: int, head) -> None:
        """Choose a layer and a head (an index, ``"mean"`` or ``"max"``) in every view."""
        self.layer.setValue(layer)
        self.select_head(head)

    def select_head(self, head) -> None:
        i = self.head.findData(head)
        if i >= 0:
            self.head.setCurrentIndex(i)

    @property
    def formula_head(self) -> int:
        """The head the Formula tab works for: the chosen one, else (the mean or max of heads)
        the tab's own Head box."""
        head = self.selected_head
        return head if isinstance(head, int) else self.numbers.head.value()

    def _selection_changed(self, *_) -> None:
        layer, head = self.selected_layer, self.selected_head
        self.live.set_selection(layer, head)
        self.atlas.set_selection(layer, head)
        if isinstance(head, int):   # the Formula tab's Head box follows a chosen head
            self.numbers.head.blockSignals(True)
            self.numbers.head.setValue(head)
            self.numbers.head.blockSignals(False)
        self._schedule()

    def _formula_head_changed(self, head: int) -> None:
        if isinstance(self.selected_head, int) and self.selected_head != head:
            self.select_head(head)   # one head chosen: the box changes it for every tab
        else:
            self._schedule()

    def context_changed(self, *_) -> None:
        """The open conversation (or its tokens) changed: the snapshot and formula are stale."""
        self._context += 1
        self.numbers.mark_stale()
        self._schedule()

    def _explain_query(self, position: int) -> None:
        self.numbers.query.setValue(position)
        per_head = "" if isinstance(self.selected_head, int) else \
            f" (head {self.formula_head}: the formula is per head; choose another in its Head box)"
        self.status.setText(f"Query token #{position} chosen: see the Formula tab{per_head}.")

    # ---- visibility: capture only while the Live tab is on screen ----------------------
    def set_on_screen(self, on: bool) -> None:
        """The dock's ``visibilityChanged``: a dock tabbed behind another stays "visible" to Qt
        but is not on screen."""
        self._on_screen = on
        self._update_active()
        if on:
            self._schedule()

    @property
    def on_screen(self) -> bool:
        return self._on_screen and self.isVisible()

    def _update_active(self) -> None:
        self.client.set_active(self.on_screen and self.tabs.currentIndex() == LIVE)

    def showEvent(self, event) -> None:  # noqa: N802
        super().showEvent(event)
        self._update_active()
        self._schedule()
        self.insight.schedule_plan()   # Explain's estimate, if that view shows

    def hideEvent(self, event) -> None:  # noqa: N802
        super().hideEvent(event)
        self._update_active()

    def _tab_changed(self, index: int) -> None:
        self._update_active()
        self._schedule()

    # ---- requests ----------------------------------------------------------------------
    def _key(self, view: int) -> tuple | None:
        conv = self.main.current_conversation
        layer, head = self.selected_layer, self.selected_head
        if view == SNAPSHOT:
            return (conv, self._context, layer, head)
        if view == NUMBERS:
            return (conv, self._context, layer, self.formula_head, self.numbers.query.value(), self.numbers.top.value())
        if view == ATLAS:
            return (self._model_path(),)
        return None

    def _model_path(self) -> str:
        info = self.main.engine.model or {}
        return str(info.get("path", ""))

    def _schedule(self, *_) -> None:
        if self.on_screen and self.tabs.currentIndex() != LIVE:
            self._timer.start()

    def _request_current(self) -> None:
        if self.on_screen:
            self.request(self.tabs.currentIndex())

    def request(self, view: int, *, force: bool = False) -> int | None:
        """Ask the engine for ``view``'s data unless it already shows (or awaits) it; the request id."""
        if not self.main.engine.model:
            self.status.setText("Load a model to see its attention.")
            return None
        key = self._key(view)
        if key is None or (not force and (self._done.get(view) == key or self._asked.get(view) == key)):
            return None
        conv = self.main.current_conversation
        history = [(m.role, m.content) for m in self.main.store.messages(conv)] if conv else []
        if view in (SNAPSHOT, NUMBERS) and not history:
            self.status.setText("Open a conversation (or send a message) to see its attention.")
            return None
        system = self.main.generation().get("system_prompt") or ""
        layer, head = self.selected_layer, self.selected_head
        if view == SNAPSHOT:
            rid = self.client.snapshot(conv, history, system, layer, head)
        elif view == NUMBERS:
            rid = self.client.explain(conv, history, system, layer, self.formula_head, self.numbers.query.value(),
                                      self.numbers.top.value())
        else:
            rid = self.client.atlas()
        self._pending[view], self._asked[view] = rid, key
        busy = " (after the reply in progress)" if self.main.replying else ""
        what = {SNAPSHOT: "the snapshot", NUMBERS: "the formula's numbers", ATLAS: "every head's scores"}[view]
        self.status.setText(f"Computing {what}{busy}…")
        return rid

    def busy(self, view: int) -> bool:
        """True while ``view``'s data is being computed."""
        return view in self._pending

    def _finish(self, view: int, d: dict) -> bool:
        if self._pending.get(view) != d["request"]:
            return False                     # an older request's answer
        self._pending.pop(view, None)
        self._done[view] = self._asked.get(view)
        self.status.setText("")
        return True

    def _on_live(self, frame: dict) -> None:
        self.live.set_frame(frame)

    def _on_snapshot(self, d: dict) -> None:
        if self._finish(SNAPSHOT, d):
            self.snapshot.set_snapshot(d)

    def _on_numbers(self, d: dict) -> None:
        if self._finish(NUMBERS, d):
            self.numbers.set_steps(d)

    def _on_atlas(self, d: dict) -> None:
        if self._finish(ATLAS, d):
            self.atlas.set_scores(d)
            self.atlas.set_selection(self.selected_layer, self.selected_head)

    def _on_failed(self, request: int, message: str) -> None:
        for view, rid in list(self._pending.items()):
            if rid == request:
                del self._pending[view]
                self._asked.pop(view, None)
                if view == NUMBERS:   # e.g. a query token past the end of an edited conversation
                    self.numbers.show_failure(message)
        self.status.setText(message)

    # ---- export ------------------------------------------------------------------------
    def view_name(self) -> str:
        i = self.tabs.currentIndex()
        return ("live", "snapshot", "heads", "formula")[i] if i < INSIGHT else f"insight-{self.insight.tabs.view_name()}"

    def export_png(self, path: str | Path) -> None:
        """The current view as a PNG image (as drawn, at the screen's pixel ratio)."""
        if not self.tabs.currentWidget().grab().save(str(path), "PNG"):
            raise OSError(f"could not write {path}")

    def export_npz(self, path: str | Path) -> None:
        """The current view's numbers as a compressed .npz (NumPy arrays; see each view's ``data()``).

        Raises:
            ValueError: the view shows nothing yet.
        """
        data = self.tabs.currentWidget().data()
        if not data:
            raise ValueError("this view shows nothing yet")
        np.savez_compressed(str(path), **{k: np.asarray(v) for k, v in data.items() if v is not None})

    def _export_dialog(self, ext: str, kind: str, write) -> None:
        name = f"attention-{self.view_name()}-L{self.selected_layer}-{self.selected_head}{ext}"
        path = save_file_name(self, "Export the attention view", name, kind)
        if not path:
            return
        try:
            write(path)
        except (OSError, ValueError) as e:
            self.status.setText(f"Could not export: {e}")
        else:
            self.status.setText(f"Exported to {path}")

    def _export_png_dialog(self) -> None:
        self._export_dialog(".png", "PNG images (*.png)", self.export_png)

    def _export_npz_dialog(self) -> None:
        self._export_dialog(".npz", "NumPy data (*.npz)", self.export_npz)


def install_attention_panel(window) -> AttentionPanel:
    """Add the attention panel to ``window`` (a ``MainWindow``) as a dock, closed unless the
    saved window state had it open."""
    client = AttentionClient(window.engine, window)
    panel = AttentionPanel(client, window)
    dock = window.add_panel(PANEL_NAME, "Attention", panel, visible=False)
    if dock.isHidden() and not dock.isFloating() and not window.tabifiedDockWidgets(dock):
        # Share the right-hand area with the panel already there (as tabs), so opening this
        # one does not squeeze both or grow the window past the screen.
        area = window.dockWidgetArea(dock)
        for name, other in window.panels.items():
            if name != PANEL_NAME and not other.isFloating() and window.dockWidgetArea(other) == area:
                window.tabifyDockWidget(other, dock)
                break
    dock.toggleViewAction().triggered.connect(lambda on: on and dock.raise_())
    dock.visibilityChanged.connect(panel.set_on_screen)
    panel.set_on_screen(not dock.isHidden())
    return panel
