"""Heatmaps drawn as one image: max-pooling to the pixels, colour mapping, hover lookup.

The attention view's matrices (a 2,048-token snapshot is 4 million cells) are never
one widget or one item per cell: :func:`max_pool` shrinks a matrix to at most one
cell per device pixel, keeping each block's maximum so a one-pixel stripe (every
query looking at one token) survives, and :func:`colorize` maps the result through a
256-entry lookup table into an RGBA array that becomes one ``QImage``. Both are
vectorised numpy (tens of milliseconds for 2,048 x 2,048), so they run on the GUI thread
without stalling it. The causal mask is not stored in the matrix: :func:`causal_mask`
marks the pooled cells whose whole block lies above the diagonal, and :func:`colorize`
gives masked (``NaN``) cells their own colour.

Must not import torch or runtime.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFontMetricsF, QImage, QLinearGradient, QMouseEvent, QPainter, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

__all__ = ["ColorBar", "HeatmapWidget", "LUT", "causal_mask", "colorize", "edges", "max_pool", "to_qimage"]

#: viridis (perceptually uniform, readable by most colour-blind viewers), 256 x RGB uint8.
LUT: np.ndarray = pg.colormap.get("viridis").getLookupTable(nPts=256, alpha=False).astype(np.uint8)


def edges(n: int, cells: int) -> np.ndarray:
    """Start index of each of ``min(n, cells)`` near-equal blocks over ``0..n-1`` (plus ``n``)."""
    k = max(1, min(n, cells))
    return np.linspace(0, n, k + 1).astype(np.int64)


def max_pool(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Max-pool ``a (R, C)`` down to at most ``(rows, cols)`` cells (never up).

    Each output cell is the maximum of its block; ``NaN`` (masked) cells are ignored
    unless the whole block is masked (``np.fmax``).

    Returns:
        ``(min(R, rows), min(C, cols))`` float32, always a new array (never ``a`` itself).
    """
    a = np.asarray(a, dtype=np.float32)
    R, C = a.shape
    if R == 0 or C == 0:
        return a.copy()
    r, c = edges(R, rows)[:-1], edges(C, cols)[:-1]
    out = a if len(c) == C else np.fmax.reduceat(a, c, axis=1)  # along rows first: contiguous
    out = out if len(r) == R else np.fmax.reduceat(out, r, axis=0)
    return out.copy() if out is a else out


def causal_mask(R: int, C: int, rows: int, cols: int, offset: int = 0) -> np.ndarray:
    """Which cells of ``max_pool(a (R, C), rows, cols)`` lie wholly in the causal upper
    triangle (cell ``(i, j)`` of ``a`` is masked when ``j + offset > i``).

    Returns:
        a boolean array of the pooled shape.
    """
    re, ce = edges(R, rows), edges(C, cols)
    last_row = re[1:] - 1                         # the last query row of each block
    return (ce[:-1][None, :] + offset) > last_row[:, None]


def colorize(values: np.ndarray, vmax: float, *, gamma: float = 1.0, masked=(128, 128, 128)) -> np.ndarray:
    """``(h, w)`` values in ``[0, vmax]`` -> ``(h, w, 4)`` RGBA uint8 through :data:`LUT`.

    ``gamma`` < 1 lifts small values (0.5: colour by the square root of the weight);
    ``NaN`` cells get ``masked`` (an RGB triple).
    """
    v = np.asarray(values, dtype=np.float32)
    nan = np.isnan(v)
    x = np.nan_to_num(v, nan=0.0) / (vmax if vmax > 0 else 1.0)
    np.clip(x, 0.0, 1.0, out=x)
    if gamma != 1.0:
        np.power(x, gamma, out=x)
    rgba = np.empty(v.shape + (4,), dtype=np.uint8)
    rgba[..., :3] = LUT[(x * 255.0 + 0.5).astype(np.uint8)]
    rgba[..., 3] = 255
    rgba[nan, :3] = masked
    return rgba


def to_qimage(rgba: np.ndarray) -> QImage:
    """An owned ``QImage`` copy of an ``(h, w, 4)`` RGBA uint8 array."""
    rgba = np.ascontiguousarray(rgba)
    h, w = rgba.shape[:2]
    return QImage(rgba.data, w, h, 4 * w, QImage.Format.Format_RGBA8888).copy()


class HeatmapWidget(QWidget):
    """A matrix painted as one image, max-pooled to the widget's device pixels.

    Rows run top to bottom, columns left to right. Hover and clicks report the cell
    under the mouse in matrix coordinates: when several cells share a pixel, the one
    with the largest value (the one the pixel shows).

    Signals:
        hovered(row, col): the cell under the mouse (``-1, -1`` when it leaves).
        clicked(row, col): a left click on a cell.
    """

    hovered = Signal(int, int)
    clicked = Signal(int, int)

    def __init__(self, parent: QWidget | None = None, *, square: bool = False, min_size: QSize = QSize(120, 24)):
        super().__init__(parent)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumSize(min_size)
        self.square = square
        self.values: np.ndarray | None = None
        self.causal: int | None = None   # cell (i, j) is masked when j + causal > i (None: no mask)
        self.vmax = 1.0
        self.gamma = 1.0
        self.selected_row: int | None = None
        self.axes = (False, False)
        self.row_offset = self.col_offset = 0
        self.min_left = 0.0   # at least this much room on the left (to line up with another heatmap)
        self.selected_col: int | None = None
        self._image: QImage | None = None
        self._image_key: tuple | None = None

    # ---- data --------------------------------------------------------------------------
    def set_values(self, values: np.ndarray | None, *, vmax: float | None = None, gamma: float | None = None,
                   causal: int | None = None) -> None:
        """Show ``values (R, C)`` (``NaN`` = masked); ``vmax`` defaults to the largest value.

        ``causal``: mask cell ``(i, j)`` when ``j + causal > i`` (0: the upper triangle of a
        square attention matrix; 1: the same with the first key column left out).
        """
        self.values = None if values is None else np.asarray(values, dtype=np.float32)
        self.causal = causal
        if vmax is not None:
            self.vmax = vmax
        elif self.values is not None and self.values.size:
            self.vmax = float(np.nanmax(self.values)) or 1.0
        if gamma is not None:
            self.gamma = gamma
        self._image = None
        self.update()

    def set_selection(self, row: int | None = None, col: int | None = None) -> None:
        """Outline one row and/or one column (None: none)."""
        self.selected_row, self.selected_col = row, col
        self.update()

    # ---- geometry ----------------------------------------------------------------------
    def set_axes(self, *, rows: bool = True, cols: bool = True, row_offset: int = 0, col_offset: int = 0) -> None:
        """Number the rows (left) and columns (below); a tick reads ``index + offset``."""
        self.axes = (rows, cols)
        self.row_offset, self.col_offset = row_offset, col_offset
        self._image = None
        self.update()

    def _margins(self) -> tuple[float, float]:
        """Room for the row numbers (left) and the column numbers (below), in pixels."""
        if self.values is None:
            return 0.0, 0.0
        fm = QFontMetricsF(self.font())
        R, C = self.values.shape
        left = fm.horizontalAdvance(str(R - 1 + self.row_offset)) + 6 if self.axes[0] else 0.0
        left = max(left, self.min_left)
        bottom = fm.height() + 2 if self.axes[1] else 0.0
        return left, bottom

    def plot_rect(self) -> QRectF:
        """Where the matrix is drawn, in widget coordinates (square cells when ``square``)."""
        left, bottom = self._margins()
        r = QRectF(self.rect()).adjusted(1 + left, 1, -1, -1 - bottom)
        if self.values is None or not self.square:
            return r
        R, C = self.values.shape
        s = min(r.width() / max(C, 1), r.height() / max(R, 1))
        w, h = s * C, s * R
        return QRectF(r.left() + (r.width() - w) / 2, r.top(), w, h)   # centred, at the top

    @staticmethod
    def _step(n: int, cell_px: float, label_px: float) -> int:
        """A tick every 1, 2, 5, 10, 20, 50… cells, so labels ``label_px`` wide never touch."""
        for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10_000):
            if step * cell_px >= label_px:
                return step
        return max(n, 1)

    def _paint_axes(self, p: QPainter, pr: QRectF) -> None:
        fm = QFontMetricsF(self.font())
        R, C = self.values.shape
        p.setPen(self.palette().color(QPalette.ColorRole.WindowText))
        if self.axes[0]:
            step = self._step(R, pr.height() / R, fm.height() * 1.3)
            for i in range(0, R, step):
                y = pr.top() + (i + 0.5) * pr.height() / R
                p.drawText(QRectF(0, y - fm.height() / 2, pr.left() - 4, fm.height()),
                           Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, str(i + self.row_offset))
        if self.axes[1]:
            label_w = fm.horizontalAdvance(str(C - 1 + self.col_offset)) + 8
            step = self._step(C, pr.width() / C, label_w)
            for j in range(0, C, step):
                x = pr.left() + (j + 0.5) * pr.width() / C
                p.drawText(QRectF(x - label_w / 2, pr.bottom() + 1, label_w, fm.height()),
                           Qt.AlignmentFlag.AlignCenter, str(j + self.col_offset))

    def cell_at(self, pos: QPointF) -> tuple[int, int]:
        """The matrix cell under ``pos`` (``(-1, -1)`` outside): the block's maximum when pooled."""
        if self.values is None:
            return -1, -1
        pr = self.plot_rect()
        if not pr.contains(pos) or pr.width() <= 0 or pr.height() <= 0:
            return -1, -1
        R, C = self.values.shape
        dpr = self.devicePixelRatioF()
        re, ce = edges(R, int(pr.height() * dpr)), edges(C, int(pr.width() * dpr))
        i = min(int((pos.y() - pr.top()) / pr.height() * (len(re) - 1)), len(re) - 2)
        j = min(int((pos.x() - pr.left()) / pr.width() * (len(ce) - 1)), len(ce) - 2)
        block = self.values[re[i] : re[i + 1], ce[j] : ce[j + 1]]
        masked = self.causal is not None and ce[j] + self.causal > re[i + 1] - 1
        if block.size == 1 or masked or np.isnan(block).all():
            return int(re[i]), int(ce[j])
        bi, bj = np.unravel_index(int(np.nanargmax(block)), block.shape)
        return int(re[i] + bi), int(ce[j] + bj)

    def _masked_rgb(self) -> tuple[int, int, int]:
        c = self.palette().color(QPalette.ColorRole.Window)
        c = c.darker(112) if c.lightness() > 128 else c.lighter(135)
        return c.red(), c.green(), c.blue()

    def image(self) -> QImage | None:
        """The pooled, coloured image for the current size (cached until size, data or palette change)."""
        if self.values is None or self.values.size == 0:
            return None
        pr = self.plot_rect()
        dpr = self.devicePixelRatioF()
        key = (int(pr.width() * dpr), int(pr.height() * dpr), self._masked_rgb())
        if self._image is None or self._image_key != key:
            rows, cols = max(1, key[1]), max(1, key[0])
            pooled = max_pool(self.values, rows, cols)
            if self.causal is not None:
                pooled[causal_mask(*self.values.shape, rows, cols, self.causal)] = np.nan
            self._image = to_qimage(colorize(pooled, self.vmax, gamma=self.gamma, masked=key[2]))
            self._image_key = key
        return self._image

    # ---- Qt ----------------------------------------------------------------------------
    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(360, 360) if self.square else QSize(360, 80)

    def changeEvent(self, event) -> None:  # noqa: N802
        if event.type() == event.Type.PaletteChange:
            self._image = None
        super().changeEvent(event)

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        img = self.image()
        if img is None:
            p.setPen(self.palette().color(QPalette.ColorRole.PlaceholderText))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, self.placeholder())
            return
        pr = self.plot_rect()
        p.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, False)  # nearest: crisp cells
        p.drawImage(pr, img)
        self._paint_axes(p, pr)
        R, C = self.values.shape
        pen = QPen(self.palette().color(QPalette.ColorRole.Highlight), 1.5)
        p.setPen(pen)
        p.setBrush(Qt.BrushStyle.NoBrush)
        if self.selected_row is not None and 0 <= self.selected_row < R:
            y0 = pr.top() + pr.height() * self.selected_row / R
            p.drawRect(QRectF(pr.left(), y0, pr.width(), max(pr.height() / R, 2.0)))
        if self.selected_col is not None and 0 <= self.selected_col < C:
            x0 = pr.left() + pr.width() * self.selected_col / C
            p.drawRect(QRectF(x0, pr.top(), max(pr.width() / C, 2.0), pr.height()))

    def placeholder(self) -> str:
        return self.property("placeholder") or ""

    def mouseMoveEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        self.hovered.emit(*self.cell_at(event.position()))
        super().mouseMoveEvent(event)

    def leaveEvent(self, event) -> None:  # noqa: N802
        self.hovered.emit(-1, -1)
        super().leaveEvent(event)

    def mousePressEvent(self, event: QMouseEvent) -> None:  # noqa: N802
        if event.button() == Qt.MouseButton.LeftButton:
            i, j = self.cell_at(event.position())
            if i >= 0:
                self.clicked.emit(i, j)
        super().mousePressEvent(event)



class ColorBar(QWidget):
    """The colour scale of a heatmap: :data:`LUT` from 0 to ``vmax``, with both ends labelled."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.vmax, self.gamma, self.title = 1.0, 1.0, "weight"
        fm = QFontMetricsF(self.font())
        self.setFixedHeight(int(fm.height() + 4))
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_scale(self, vmax: float, gamma: float = 1.0, title: str | None = None) -> None:
        self.vmax, self.gamma = vmax, gamma
        if title is not None:
            self.title = title
        self.update()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(240, self.height())

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        fm = QFontMetricsF(self.font())
        scale = " (√ scale)" if self.gamma != 1.0 else ""
        left = f"{self.title}{scale}  0"
        right = f"{self.vmax:.3g}"
        lw, rw = fm.horizontalAdvance(left) + 6, fm.horizontalAdvance(right) + 6
        bar = QRectF(lw, 3, max(self.width() - lw - rw, 10), self.height() - 6)
        g = QLinearGradient(bar.topLeft(), bar.topRight())
        for i in range(0, 256, 15):
            c = LUT[i]
            g.setColorAt(i / 255, QColor(int(c[0]), int(c[1]), int(c[2])))
        g.setColorAt(1.0, QColor(*(int(v) for v in LUT[255])))
        p.fillRect(bar, g)
        p.setPen(self.palette().color(QPalette.ColorRole.WindowText))
        p.drawText(QRectF(0, 0, lw - 4, self.height()), Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, left)
        p.drawText(QRectF(bar.right() + 4, 0, rw, self.height()), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, right)
