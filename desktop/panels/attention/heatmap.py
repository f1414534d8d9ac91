"""Heatmaps drawn as one image: max-pooling to the pixels, colour mapping, hover lookup.

The attention view's matrices (a 2,048-token snapshot is 4 million cells) are never
one widget or one item per cell: :func:`max_pool` shrinks a matrix to at most one
cell per device pixel, keeping each block's maximum so a one-pixel stripe (every
query looking at one token) survives, and :func:`colorize` maps the result through a
256-entry lookup table into an RGBA array that becomes one ``QImage``. Both are
vectorised numpy: a few milliseconds for a small matrix, which is drawn at once, and
tens of milliseconds for 2,048 x 2,048, which :func:`in_background` pools and colours on a
helper thread (numpy releases the GIL) while the event loop runs on and the previous
image stays on screen. The causal mask is not stored in the matrix: :func:`causal_mask`
marks the pooled cells whose whole block lies above the diagonal, and :func:`colorize`
gives masked (``NaN``) cells their own colour.

Must not import torch or runtime.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFontMetricsF, QImage, QLinearGradient, QMouseEvent, QPainter, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

__all__ = ["ColorBar", "HeatmapWidget", "LUT", "SYNC_CELLS", "causal_mask", "colorize", "edges", "in_background",
           "max_pool", "render", "to_qimage"]

log = logging.getLogger(__name__)

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


def render(values: np.ndarray, rows: int, cols: int, *, vmax: float | None, gamma: float, causal: int | None,
           masked=(128, 128, 128)) -> tuple[np.ndarray, float]:
    """Pool ``values`` to at most ``(rows, cols)``, mask, colour: ``(RGBA (h, w, 4) uint8, vmax)``.

    ``vmax`` None: the largest value (1.0 when there is none). Pure numpy: safe off the GUI thread.
    """
    if vmax is None:
        vmax = float(np.nanmax(values)) if values.size and not np.isnan(values).all() else 1.0
        vmax = vmax or 1.0
    pooled = max_pool(values, rows, cols)
    if causal is not None:
        pooled[causal_mask(*values.shape, rows, cols, causal)] = np.nan
    return colorize(pooled, vmax, gamma=gamma, masked=masked), vmax


#: Up to this many cells a matrix is drawn at once on the GUI thread (a few milliseconds);
#: a larger one (a long conversation's snapshot) on the helper thread.
SYNC_CELLS = 1 << 18


class _Relay(QObject):
    """Carries a finished background job back to the GUI thread (a queued signal)."""

    done = Signal(object, object)   # callback, Future


_relay: _Relay | None = None
_pool: ThreadPoolExecutor | None = None


def _deliver(callback: Callable[[Any], None], future: Future) -> None:
    try:
        result = future.result()
    except Exception:  # noqa: BLE001 - a drawing that failed is logged, the old one stays
        log.exception("a background drawing job failed")
        return
    try:
        callback(result)
    except RuntimeError as e:  # the widget it was for is gone
        if "already deleted" not in str(e):
            raise


def in_background(fn: Callable[[], Any], callback: Callable[[Any], None]) -> None:
    """Run ``fn()`` on the drawing helper thread, then ``callback(result)`` on the GUI thread.

    Call from the GUI thread. One helper thread: jobs run in order; a caller that has
    moved on ignores a stale result (the widgets compare a job key).
    """
    global _relay, _pool
    if _relay is None:
        _relay = _Relay()
        _relay.done.connect(_deliver)
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnchat-draw")
    relay = _relay
    _pool.submit(fn).add_done_callback(lambda f: relay.done.emit(callback, f))


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
    drawn = Signal()

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
        self._pending_key: tuple | None = None
        self._auto_vmax = True
        self._version = 0   # bumped by set_values: part of the image key

    # ---- data --------------------------------------------------------------------------
    def set_values(self, values: np.ndarray | None, *, vmax: float | None = None, gamma: float | None = None,
                   causal: int | None = None) -> None:
        """Show ``values (R, C)`` (``NaN`` = masked); ``vmax`` defaults to the largest value.

        ``causal``: mask cell ``(i, j)`` when ``j + causal > i`` (0: the upper triangle of a
        square attention matrix; 1: the same with the first key column left out).
        """
        self.values = None if values is None else np.asarray(values, dtype=np.float32)
        self.causal = causal
        self._auto_vmax = vmax is None
        if vmax is not None:
            self.vmax = vmax
        elif self.values is not None and self.values.size <= SYNC_CELLS and not np.isnan(self.values).all():
            self.vmax = float(np.nanmax(self.values)) or 1.0   # (a large one's is found off the GUI thread)
        if gamma is not None:
            self.gamma = gamma
        self._version += 1
        self.update()

    def set_selection(self, row: int | None = None, col: int | None = None) -> None:
        """Outline one cell (both given), one row or one column (None: none)."""
        self.selected_row, self.selected_col = row, col
        self.update()

    # ---- geometry ----------------------------------------------------------------------
    def set_axes(self, *, rows: bool = True, cols: bool = True, row_offset: int = 0, col_offset: int = 0) -> None:
        """Number the rows (left) and columns (below); a tick reads ``index + offset``."""
        self.axes = (rows, cols)
        self.row_offset, self.col_offset = row_offset, col_offset
        self._image = None
        self.update()

    def margins(self) -> tuple[float, float]:
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
        left, bottom = self.margins()
        top = QFontMetricsF(self.font()).height() / 2 if self.axes[0] and self.values is not None else 0.0
        r = QRectF(self.rect()).adjusted(1 + left, 1 + top, -1, -1 - bottom)
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
            for i in range((-self.row_offset) % step, R, step):   # round numbers: 0, 5, 10…
                y = pr.top() + (i + 0.5) * pr.height() / R
                p.drawText(QRectF(0, y - fm.height() / 2, pr.left() - 4, fm.height()),
                           Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, str(i + self.row_offset))
        if self.axes[1]:
            label_w = fm.horizontalAdvance(str(C - 1 + self.col_offset)) + 8
            step = self._step(C, pr.width() / C, label_w)
            for j in range((-self.col_offset) % step, C, step):
                x = pr.left() + (j + 0.5) * pr.width() / C
                x0 = min(max(x - label_w / 2, 0.0), self.width() - label_w)   # never clipped at an edge
                p.drawText(QRectF(x0, pr.bottom() + 1, label_w, fm.height()),
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

    def _key(self) -> tuple:
        pr = self.plot_rect()
        dpr = self.devicePixelRatioF()
        return (self._version, max(1, int(pr.width() * dpr)), max(1, int(pr.height() * dpr)), self._masked_rgb(),
                self.vmax if not self._auto_vmax else None, self.gamma, self.causal)

    def ready(self) -> bool:
        """True when the image on screen is the one for the current data, size and palette."""
        return self.values is None or self.values.size == 0 or (self._image is not None and self._image_key == self._key())

    def image(self) -> QImage | None:
        """The pooled, coloured image for the current size (cached until size, data or palette change).

        A large matrix is drawn in the background: until it is done this returns the
        previous image (None at first) and :attr:`drawn` fires when the new one is in.
        """
        if self.values is None or self.values.size == 0:
            return None
        key = self._key()
        if self._image is not None and self._image_key == key:
            return self._image
        _, cols, rows, masked, vmax, gamma, causal = key
        if self.values.size <= SYNC_CELLS:
            rgba, vmax = render(self.values, rows, cols, vmax=vmax, gamma=gamma, causal=causal, masked=masked)
            self._drawn(key, (rgba, vmax), pending=False)
        elif self._pending_key != key:
            self._pending_key = key
            values = self.values
            in_background(lambda: render(values, rows, cols, vmax=vmax, gamma=gamma, causal=causal, masked=masked),
                          lambda result: self._drawn(key, result))
        return self._image

    def _drawn(self, key: tuple, result: tuple[np.ndarray, float], *, pending: bool = True) -> None:
        if pending:
            if key != self._pending_key:   # superseded by newer data or another size
                return
            self._pending_key = None
        rgba, vmax = result
        if self._auto_vmax:
            self.vmax = vmax
        self._image, self._image_key = to_qimage(rgba), key
        if pending:
            self.update()
        self.drawn.emit()

    # ---- Qt ----------------------------------------------------------------------------
    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(360, 360) if self.square else QSize(360, 80)

    def changeEvent(self, event) -> None:  # noqa: N802
        if event.type() == event.Type.PaletteChange:
            self.update()   # the masked colour is part of the image key
        super().changeEvent(event)

    def paintEvent(self, event) -> None:  # noqa: N802
        p = QPainter(self)
        img = self.image()
        if img is None:
            p.setPen(self.palette().color(QPalette.ColorRole.PlaceholderText))
            text = "Drawing…" if self._pending_key is not None else self.placeholder()
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, text)
            return
        pr = self.plot_rect()
        p.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, False)  # nearest: crisp cells
        p.drawImage(pr, img)
        self._paint_axes(p, pr)
        R, C = self.values.shape
        pen = QPen(self.palette().color(QPalette.ColorRole.Highlight), 1.5)
        p.setPen(pen)
        p.setBrush(Qt.BrushStyle.NoBrush)
        row = self.selected_row if self.selected_row is not None and 0 <= self.selected_row < R else None
        col = self.selected_col if self.selected_col is not None and 0 <= self.selected_col < C else None
        ch, cw = max(pr.height() / R, 2.0), max(pr.width() / C, 2.0)
        y0 = pr.top() + pr.height() * row / R if row is not None else pr.top()
        x0 = pr.left() + pr.width() * col / C if col is not None else pr.left()
        if row is not None or col is not None:   # one cell, or a whole row or column
            p.drawRect(QRectF(x0, y0, cw if col is not None else pr.width(), ch if row is not None else pr.height()))

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
