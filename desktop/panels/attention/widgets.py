"""Two small painted widgets for the attention view: the conversation's tokens with a
weight behind each, and one bar per head.

:class:`TokenHeatText` lays the tokens out like text (wrapping at the widget's width,
breaking lines after newlines) and paints only the rows in view, so a context of
thousands of tokens repaints in a millisecond or two; appending tokens lays out only
the new ones. :class:`EntropyBars` draws a value per head with the selected head
highlighted. Must not import torch or runtime.
"""
from __future__ import annotations

import bisect

import numpy as np
from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFontMetricsF, QMouseEvent, QPainter, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

__all__ = ["EntropyBars", "TokenHeatText", "display_token"]


def display_token(text: str) -> str:
    """A token as a label: newlines as ↵, tabs as →, nothing as ∅ (spaces kept)."""
    if text == "":
        return "∅"
    return text.replace("\r", "").replace("\n", "↵").replace("\t", "→")


class TokenHeatText(QWidget):
    """Tokens flowed like text; behind each, the highlight colour at its weight's strength.

    Signals:
        hovered(index): the token under the mouse (-1: none).
        clicked(index): a token was clicked.
    """

    hovered = Signal(int)
    clicked = Signal(int)
    PAD_X, PAD_Y, GAP = 2.0, 1.0, 1.0

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.tokens: list[str] = []
        self.strength: np.ndarray | None = None   # (T,) in 0..1: how strongly to colour each token
        self.weights: np.ndarray | None = None    # (T,) the weights themselves (tooltips)
        self.marked = -1                           # outlined token (the query)
        self.kept: np.ndarray | None = None        # (T,) share of the layer's heads holding each token (None: all)
        self._xs: list[float] = []
        self._ys: list[float] = []
        self._ws: list[float] = []
        self._labels: list[str] = []
        self._cursor = (0.0, 0.0)
        self._width = -1.0
        self._widths: dict[str, float] = {}

    # ---- data --------------------------------------------------------------------------
    def set_tokens(self, tokens: list[str]) -> None:
        n = len(self.tokens)
        if len(tokens) >= n and tokens[:n] == self.tokens:
            self.tokens = list(tokens)
            self._layout_from(n)                   # only the new tokens
        else:
            self.tokens = list(tokens)
            self._relayout()
        self.update()

    def set_weights(self, weights: np.ndarray | None, strength: np.ndarray | None = None, marked: int = -1) -> None:
        """``weights (T,)`` for tooltips; ``strength (T,)`` in 0..1 colours them (default: weight / max)."""
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float32)
        if strength is None and self.weights is not None and self.weights.size:
            m = float(self.weights.max()) or 1.0
            strength = self.weights / m
        self.strength = strength
        self.marked = marked
        self.update()

    def set_kept(self, kept: np.ndarray | None) -> None:
        """``kept (T,)`` in 0..1: the share of the layer's heads that still hold each token
        (a cache policy evicted the rest); tokens below 1 are drawn grey, those at 0 on grey."""
        self.kept = None if kept is None else np.asarray(kept, dtype=np.float32)
        self.update()

    # ---- layout ------------------------------------------------------------------------
    def _line_height(self) -> float:
        return QFontMetricsF(self.font()).height() + 2 * self.PAD_Y + self.GAP

    def _relayout(self) -> None:
        self._xs, self._ys, self._ws, self._labels = [], [], [], []
        self._cursor = (0.0, 0.0)
        self._width = float(self.width())
        self._widths.clear()
        self._layout_from(0)

    def _layout_from(self, start: int) -> None:
        fm = QFontMetricsF(self.font())
        lh = self._line_height()
        x, y = self._cursor
        width = max(self._width, 40.0)
        for tok in self.tokens[start:]:
            label = display_token(tok)
            w = self._widths.get(label)
            if w is None:
                w = self._widths[label] = fm.horizontalAdvance(label) + 2 * self.PAD_X
            if x > 0 and x + w > width:
                x, y = 0.0, y + lh
            self._xs.append(x)
            self._ys.append(y)
            self._ws.append(w)
            self._labels.append(label)
            x += w + self.GAP
            if "\n" in tok:
                x, y = 0.0, y + lh
        self._cursor = (x, y)
        h = int(y + (lh if x > 0 or not self.tokens else 0) + 4)
        if self.minimumHeight() != h:
            self.setMinimumHeight(h)

    def token_rect(self, i: int) -> QRectF:
        return QRectF(self._xs[i], self._ys[i], self._ws[i], self._line_height() - self.GAP)

    def token_at(self, pos: QPointF) -> int:
        lh = self._line_height()
        row_y = (pos.y() // lh) * lh
        lo = bisect.bisect_left(self._ys, row_y)
        hi = bisect.bisect_right(self._ys, row_y)
        for i in range(lo, hi):
            if self._xs[i] <= pos.x() < self._xs[i] + self._ws[i]:
                return i
        return -1

    # ---- Qt ----------------------------------------------------------------------------
    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(320, max(self.minimumHeight(), 60))

    def resizeEvent(self, event) -> None:  # noqa: N802
        if abs(event.size().width() - self._width) > 0.5:
            self._relayout()
        super().resizeEvent(event)

    def changeEvent(self, event) -> None:  # noqa: N802
        if event.type() == event.Type.FontChange:
            self._relayout()
        super().changeEvent(event)

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        pal = self.palette()
        if not self.tokens:
            p.setPen(pal.color(QPalette.ColorRole.PlaceholderText))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                       self.property("placeholder") or "")
            return
        exposed = QRectF(event.rect())
        lh = self._line_height()
        lo = bisect.bisect_left(self._ys, exposed.top() - lh)
        hi = bisect.bisect_right(self._ys, exposed.bottom())
        hl = QColor(pal.color(QPalette.ColorRole.Highlight))
        text = pal.color(QPalette.ColorRole.Text)
        bright = pal.color(QPalette.ColorRole.HighlightedText)
        s = self.strength
        kept = self.kept
        grey = pal.color(QPalette.ColorRole.PlaceholderText)
        gone = QColor(pal.color(QPalette.ColorRole.Mid))
        gone.setAlphaF(0.35)
        for i in range(lo, hi):
            r = self.token_rect(i)
            a = float(s[i]) if s is not None and i < len(s) else 0.0
            k = float(kept[i]) if kept is not None and i < len(kept) else 1.0
            if k <= 0.0:   # evicted by every head of the layer: greyed out, on grey
                p.fillRect(r, gone)
            elif a > 0.02:   # below 2 % of the strongest: no colour, so the focus stands out
                c = QColor(hl)
                c.setAlphaF(min(1.0, a ** 0.8))
                p.fillRect(r, c)
            p.setPen(grey if k < 1.0 else bright if a > 0.6 else text)
            p.drawText(r.adjusted(self.PAD_X, 0, 0, 0), Qt.AlignmentFlag.AlignVCenter, self._labels[i])
            if i == self.marked:
                p.setPen(QPen(hl, 1.5))
                p.drawRect(r.adjusted(0.5, 0.5, -0.5, -0.5))

    def mouseMoveEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        i = self.token_at(event.position())
        self.hovered.emit(i)
        if i >= 0:
            w = f"  weight {self.weights[i]:.4f}" if self.weights is not None and i < len(self.weights) else ""
            if self.kept is not None and i < len(self.kept) and self.kept[i] < 1.0:
                w += "  (evicted by this layer)" if self.kept[i] <= 0 else f"  (kept by {self.kept[i]:.0%} of its heads)"
            QToolTip.showText(event.globalPosition().toPoint(), f"#{i} “{self._labels[i]}”{w}", self)
        super().mouseMoveEvent(event)

    def mousePressEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        i = self.token_at(event.position())
        if i >= 0 and event.button() == Qt.MouseButton.LeftButton:
            self.clicked.emit(i)
        super().mousePressEvent(event)


class EntropyBars(QWidget):
    """One bar per head (e.g. attention entropy in bits), a dashed line at ``ceiling``.

    Signals:
        clicked(head): a bar was clicked.
    """

    clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.values = np.zeros(0, dtype=np.float32)
        self.ceiling = 1.0
        self.selected: int | None = None
        self.setMinimumHeight(72)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_values(self, values: np.ndarray, ceiling: float, selected: int | None = None) -> None:
        self.values = np.asarray(values, dtype=np.float32)
        self.ceiling = max(float(ceiling), float(self.values.max()) if self.values.size else 0.0, 1e-6)
        self.selected = selected
        self.update()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(320, 80)

    def _bar_rect(self, i: int) -> QRectF:
        fm = QFontMetricsF(self.font())
        top, bottom = fm.height() + 2, self.height() - fm.height() - 2
        n = max(len(self.values), 1)
        slot = self.width() / n
        h = (bottom - top) * float(self.values[i]) / self.ceiling
        return QRectF(i * slot + slot * 0.15, bottom - h, slot * 0.7, h)

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        pal = self.palette()
        fm = QFontMetricsF(self.font())
        n = len(self.values)
        if not n:
            return
        top, bottom = fm.height() + 2, self.height() - fm.height() - 2
        mid = pal.color(QPalette.ColorRole.PlaceholderText)
        p.setPen(QPen(mid, 1, Qt.PenStyle.DashLine))
        p.drawLine(QPointF(0, top), QPointF(self.width(), top))
        slot = self.width() / n
        for i in range(n):
            r = self._bar_rect(i)
            sel = i == self.selected
            p.fillRect(r, pal.color(QPalette.ColorRole.Highlight) if sel else mid)
            p.setPen(pal.color(QPalette.ColorRole.WindowText))
            label = f"{i}"
            p.drawText(QRectF(i * slot, bottom + 1, slot, fm.height()), Qt.AlignmentFlag.AlignCenter, label)
            if sel or n <= 12:
                p.drawText(QRectF(i * slot, r.top() - fm.height() - 1, slot, fm.height()),
                           Qt.AlignmentFlag.AlignCenter, f"{self.values[i]:.1f}")

    def head_at(self, x: float) -> int:
        n = len(self.values)
        return min(int(x / self.width() * n), n - 1) if n and self.width() > 0 else -1

    def mousePressEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        i = self.head_at(event.position().x())
        if i >= 0:
            self.clicked.emit(i)
        super().mousePressEvent(event)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        i = self.head_at(event.position().x())
        if i >= 0:
            QToolTip.showText(event.globalPosition().toPoint(), f"head {i}: {self.values[i]:.2f} bits", self)
        super().mouseMoveEvent(event)
