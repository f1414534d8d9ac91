"""A row of controls that wraps onto more lines when its space is narrow (Qt's Flow Layout
example, plus stretch).

A ``QHBoxLayout`` row asks for the sum of its widgets' widths: one row of spin boxes and
buttons made the attention panel 540 px wide at least, and a dock cannot be narrower than
its content, so at 1100 px the chat beside it was left 338 px. :class:`FlowLayout` asks
only for its widest item; the height it needs for a width comes from ``heightForWidth``.
On each line, widgets whose horizontal size policy expands share the width left over.

Imports Qt only.
"""
from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QLayout, QLayoutItem, QSizePolicy, QStyle, QWidget

__all__ = ["FlowLayout", "flow_row", "labelled"]


class FlowLayout(QLayout):
    """Items left to right, wrapped at the layout's width; ``spacing`` px between items and lines."""

    def __init__(self, parent: QWidget | None = None, spacing: int = 6):
        super().__init__(parent)
        self._items: list[QLayoutItem] = []
        self._stretch: dict[int, int] = {}   # id(widget) -> stretch (0: keeps its size hint)
        self.setSpacing(spacing)
        self.setContentsMargins(0, 0, 0, 0)

    # ---- QLayout's contract -----------------------------------------------------------------
    def addItem(self, item: QLayoutItem) -> None:  # noqa: N802 - Qt API
        self._items.append(item)

    def add(self, widget: QWidget, stretch: int = 0) -> None:
        """Add ``widget``; ``stretch`` > 0: it takes its share of a line's spare width (as in a box layout)."""
        if stretch:
            self._stretch[id(widget)] = stretch
        self.addWidget(widget)   # QLayout's: makes the item and calls addItem

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QLayoutItem | None:  # noqa: N802 - Qt API
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QLayoutItem | None:  # noqa: N802 - Qt API
        if 0 <= index < len(self._items):
            item = self._items.pop(index)
            if item.widget() is not None:
                self._stretch.pop(id(item.widget()), None)
            return item
        return None

    def expandingDirections(self) -> Qt.Orientation:  # noqa: N802 - Qt API
        return Qt.Orientation.Horizontal

    def hasHeightForWidth(self) -> bool:  # noqa: N802 - Qt API
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt API
        return self._place(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802 - Qt API
        super().setGeometry(rect)
        self._place(rect, move=True)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt API
        """Everything on one line."""
        shown = self._shown()
        if not shown:
            return QSize(0, 0)
        m = self.contentsMargins()
        w = sum(i.sizeHint().width() for i in shown) + self._gap() * (len(shown) - 1)
        h = max(i.sizeHint().height() for i in shown)
        return QSize(w + m.left() + m.right(), h + m.top() + m.bottom())

    def minimumSize(self) -> QSize:  # noqa: N802 - Qt API
        """The widest item: everything else can go onto another line."""
        size = QSize(0, 0)
        for item in self._shown():
            size = size.expandedTo(item.minimumSize())
        m = self.contentsMargins()
        return size + QSize(m.left() + m.right(), m.top() + m.bottom())

    # ---- placing ---------------------------------------------------------------------------------
    def _gap(self) -> int:
        s = self.spacing()
        if s >= 0:
            return s
        parent = self.parentWidget()
        return parent.style().pixelMetric(QStyle.PixelMetric.PM_LayoutHorizontalSpacing) if parent else 6

    def _shown(self) -> list[QLayoutItem]:
        return [i for i in self._items if not i.isEmpty()]

    def _grows(self, item: QLayoutItem) -> int:
        w = item.widget()
        if w is not None and id(w) in self._stretch:
            return self._stretch[id(w)]
        return 1 if w is not None and w.sizePolicy().expandingDirections() & Qt.Orientation.Horizontal else 0

    def _place(self, rect: QRect, *, move: bool) -> int:
        """Lay the items out in ``rect`` (only measure unless ``move``); the height used."""
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        gap = self._gap()
        lines: list[list[QLayoutItem]] = [[]]
        used = 0
        for item in self._shown():
            w = min(item.sizeHint().width(), area.width())
            if lines[-1] and used + gap + w > area.width():
                lines.append([])
                used = 0
            used += (gap if lines[-1] else 0) + w
            lines[-1].append(item)
        y = area.y()
        for line in filter(None, lines):
            widths = [min(i.sizeHint().width(), area.width()) for i in line]
            spare = area.width() - sum(widths) - gap * (len(line) - 1)
            shares = [self._grows(i) for i in line]
            if spare > 0 and sum(shares):
                total = sum(shares)
                widths = [w + spare * s // total for w, s in zip(widths, shares)]
            height = max(i.sizeHint().height() for i in line)
            if move:
                x = area.x()
                for item, w in zip(line, widths):
                    h = min(height, item.maximumSize().height())
                    item.setGeometry(QRect(QPoint(x, y + (height - h) // 2), QSize(w, h)))
                    x += w + gap
            y += height + gap
        return max(0, y - gap - area.y()) + m.top() + m.bottom()


def flow_row(*widgets: QWidget, stretch: dict[QWidget, int] | None = None, spacing: int = 6) -> FlowLayout:
    """A :class:`FlowLayout` holding ``widgets`` (``stretch``: a widget's share of spare width)."""
    row = FlowLayout(spacing=spacing)
    for w in widgets:
        row.add(w, (stretch or {}).get(w, 0))
    return row


def labelled(text: str, widget: QWidget, stretch: int = 1) -> QWidget:
    """``text`` and ``widget`` side by side as one item, so a wrap never parts a label from its box.
    The pair expands (in a :class:`FlowLayout` line) when ``stretch`` > 0."""
    pair = QWidget()
    row = QHBoxLayout(pair)
    row.setContentsMargins(0, 0, 0, 0)
    row.addWidget(QLabel(text))
    row.addWidget(widget, stretch)
    if stretch:
        pair.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
    return pair
