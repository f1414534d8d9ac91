"""Tabs whose row wraps onto a second line instead of hiding tabs behind scroll arrows.

A dock a quarter of a 1,100 px window wide (~280 px) showed "Live Snapshot Heads Formul◂▸":
the Insight tab was only reachable through the arrows, which a new user did not see. Here
the tab buttons sit in a :class:`desktop.flow_layout.FlowLayout`, so every tab is always in
sight; the pages are a ``QStackedWidget``. The API is ``QTabWidget``'s, as far as the panels
use it (``addTab``, ``count``, ``widget``, ``indexOf``, ``currentIndex``/``setCurrentIndex``,
``currentWidget``/``setCurrentWidget``, ``tabText``/``setTabText``, ``currentChanged``).

Imports Qt only.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QButtonGroup, QFrame, QSizePolicy, QStackedWidget, QToolButton, QVBoxLayout, QWidget

from desktop.flow_layout import FlowLayout

__all__ = ["WrappingTabs"]


class WrappingTabs(QWidget):
    """Pages chosen by a row of tab buttons that wraps at the widget's width."""

    currentChanged = Signal(int)   # noqa: N815 - QTabWidget's name

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.row = QWidget()
        self.row.setObjectName("tabRow")
        self._flow = FlowLayout(self.row, spacing=2)
        # Preferred, not Fixed or Maximum: those cap its height at one line (its size hint).
        self.row.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self.stack = QStackedWidget()
        self._group = QButtonGroup(self)
        self._group.setExclusive(True)
        self._group.idClicked.connect(self.setCurrentIndex)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        rule = QFrame()   # where the tabs end and the page begins
        rule.setFrameShape(QFrame.Shape.HLine)
        rule.setFrameShadow(QFrame.Shadow.Sunken)
        lay.addWidget(self.row)
        lay.addWidget(rule)
        lay.addWidget(self.stack, 1)
        self.stack.currentChanged.connect(self._changed)

    # ---- QTabWidget's API ---------------------------------------------------------------------
    def setDocumentMode(self, on: bool) -> None:  # noqa: N802 - QTabWidget's; the row has one look
        pass

    def addTab(self, widget: QWidget, title: str) -> int:  # noqa: N802
        button = QToolButton()
        button.setText(title)
        button.setCheckable(True)
        button.setAutoRaise(True)
        button.setObjectName(f"tab_{title.replace(' ', '_')}")
        index = self.stack.addWidget(widget)
        self._group.addButton(button, index)
        self._flow.add(button)
        if index == 0:
            button.setChecked(True)
            self._embolden(0)
        return index

    def count(self) -> int:
        return self.stack.count()

    def widget(self, index: int) -> QWidget | None:
        return self.stack.widget(index)

    def indexOf(self, widget: QWidget) -> int:  # noqa: N802
        return self.stack.indexOf(widget)

    def currentIndex(self) -> int:  # noqa: N802
        return self.stack.currentIndex()

    def setCurrentIndex(self, index: int) -> None:  # noqa: N802
        if 0 <= index < self.count():
            self.stack.setCurrentIndex(index)

    def currentWidget(self) -> QWidget | None:  # noqa: N802
        return self.stack.currentWidget()

    def setCurrentWidget(self, widget: QWidget) -> None:  # noqa: N802
        self.setCurrentIndex(self.indexOf(widget))

    def tabText(self, index: int) -> str:  # noqa: N802
        b = self._group.button(index)
        return b.text() if b is not None else ""

    def setTabText(self, index: int, text: str) -> None:  # noqa: N802
        b = self._group.button(index)
        if b is not None:
            b.setText(text)

    def tab_button(self, index: int) -> QToolButton | None:
        """The button that shows page ``index`` (for tests and screenshots)."""
        return self._group.button(index)

    # ---- internals ---------------------------------------------------------------------------
    def _changed(self, index: int) -> None:
        b = self._group.button(index)
        if b is not None and not b.isChecked():
            b.setChecked(True)
        self._embolden(index)
        self.currentChanged.emit(index)

    def _embolden(self, index: int) -> None:
        """The chosen tab's label in bold: the row has no tab shapes to tell it by."""
        for b in self._group.buttons():
            f = b.font()
            f.setBold(self._group.id(b) == index)
            b.setFont(f)
