"""The KV-cache memory panel: a live chart of the cache as the conversation grows, and a readout.

x is the context length in tokens, y is MiB. Lines: the theoretical size of each cache
dtype (bytes per token = 2 x layers x KV heads x head dim x bytes per element, times
tokens), the bytes the cache has allocated (it grows in chunks) and the bytes its tokens
use, the context limit (vertical) and the memory limit (horizontal). A truncation or
eviction adds a marker where it happened.

Data comes as the worker's stats dicts (``TurnStats.to_dict()`` with ``kv_cache``,
``conv_id``, ``request``), every 4 decoded tokens and at once after an eviction: each
is recorded at once (cheap), and the chart is redrawn by a timer at most every
:data:`REDRAW_MS` while data arrives (8 times a second), on the GUI thread, so decoding
on the worker thread is never waited on. Must not import torch.
"""
from __future__ import annotations

from typing import Callable

import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import QColor, QPalette, QPen
from PySide6.QtWidgets import QCheckBox, QLabel, QVBoxLayout, QWidget

import runtime
from desktop.remote.engine import REMOTE_KV_NOTE, usage_text
from desktop.panels.kv import labels, readout
from desktop.panels.kv.readout import OTHER_MODEL
from desktop.panels.kv.series import KVSeries, policy_next
from desktop.settings.checks import CONTEXT_KEYS, effective_context
from desktop.settings.values import DEFAULTS

__all__ = ["KVPanel", "KVSeries", "OTHER_MODEL", "REDRAW_MS", "install_kv_panel", "policy_next"]

MIB = 2**20
REDRAW_MS = 125
#: The narrowest zoomed span (tokens): a 90-token chat is half the chart, not a sliver of 1,024.
ZOOM_MIN_TOKENS = 128
#: The y axis' top with nothing to draw (no model, no reply): 1 MiB, in readable steps.
EMPTY_TOP_BYTES = MIB
COLORS = {"float32": "#e8a33d", "16-bit": "#5aa469", "int8": "#c45ab3", "allocated": "#8e7cc3", "used": "#3d7bd9",
          "full": "#7fa8e8", "limit": "#d9534f", "event": "#c94fb0"}


class KVPanel(QWidget):
    """The dock's widget. Feed it :meth:`on_model` (model info dicts) and :meth:`on_stats`.

    Args:
        settings: the app's settings (the overflow policy, sink tokens and limits
            before the first reply).
        context_fn: ``() -> tokens``: the context limit a new reply gets, before one
            reports its own (the window's ``context_limit``, which its status bar shows
            too); default: from ``settings`` (:func:`effective_context`).
    """

    def __init__(self, settings=None, parent: QWidget | None = None, *, context_fn: Callable[[], int] | None = None):
        super().__init__(parent)
        self.setObjectName("kvPanel")
        self.settings = settings
        self.context_fn = context_fn
        self.model: dict | None = None
        self.remote_stats: dict | None = None
        #: The open conversation's replies came from another model: none of their figures apply.
        self.other_model = False
        #: The open conversation's last reply when no cache of it exists now (see on_conversation).
        self.last_reply: dict | None = None
        self.series = KVSeries()
        self.redraws = 0
        self._dirty = False
        self._timer = QTimer(self)
        self._timer.setInterval(REDRAW_MS)
        self._timer.timeout.connect(self._tick)

        self.plot = pg.PlotWidget()
        self.plot.setObjectName("kvPlot")
        self.plot.setMenuEnabled(False)
        self.plot.setMinimumHeight(220)
        item = self.plot.getPlotItem()
        item.setLabel("bottom", "context (tokens)")
        item.setLabel("left", "KV cache (MiB)")
        item.getAxis("left").enableAutoSIPrefix(False)  # MiB stays MiB (no "x1e-06" on an empty chart)
        item.showGrid(x=True, y=True, alpha=0.15)
        # The legend sits under the chart, in two columns, so no line ever runs through it
        # (inside, the allocated line crossed it whenever the cache was near the chart's top).
        self.legend = pg.LegendItem(offset=None, labelTextSize="8pt", colCount=2)
        item.layout.addItem(self.legend, 4, 1)
        self.theory: dict[str, pg.PlotDataItem] = {
            "float32": item.plot(), "16-bit": item.plot(), "int8": item.plot(),
        }
        # connect="finite": a NaN breaks the line where the cache shrank (no line drawn backwards).
        self.allocated_curve = item.plot(connect="finite")
        self.used_curve = item.plot(connect="finite")
        # Under a cache policy: what a full cache would take, against the kept line ("used");
        # in the legend only while a policy has evicted something.
        self.full_curve = item.plot(connect="finite")
        # Short names: two columns fit a 280 px panel (narrower: one column); the readout
        # gives the bytes per token of each (int8: a float32 scale per vector beside the codes).
        for curve, name in ((self.theory["float32"], "float32"), (self.theory["16-bit"], "bf16 / fp16"),
                            (self.theory["int8"], "int8 + scales"),
                            (self.allocated_curve, "allocated"), (self.used_curve, "used")):
            self.legend.addItem(curve, name)
        # The width the chart needs with the legend in two columns; narrower, it takes one
        # (two columns in a 200 px panel were cut off at the right, with the chart).
        self._two_column_width = item.minimumWidth()
        self.now_dot = item.plot(pen=None, symbol="o", symbolSize=8, symbolBrush=COLORS["used"], symbolPen=None)
        self.context_line = pg.InfiniteLine(angle=90,
                                            label="context limit", labelOpts={"position": 0.62, "color": COLORS["limit"],
                                                                              "rotateAxis": (1, 0), "anchors": [(0.5, 1), (0.5, 1)]})
        self.memory_line = pg.InfiniteLine(angle=0,
                                           label="memory limit", labelOpts={"position": 0.6, "color": COLORS["limit"],
                                                                            "anchors": [(0.5, 1), (0.5, 1)]})
        item.addItem(self.context_line, ignoreBounds=True)
        item.addItem(self.memory_line, ignoreBounds=True)
        item.vb.sigResized.connect(lambda *_: self.place_labels())   # the labels' room changed
        self.event_items: list = []
        dash, dot, solid = Qt.PenStyle.DashLine, Qt.PenStyle.DotLine, Qt.PenStyle.SolidLine
        #: Each line's pen: (colour, width in logical pixels, style); see :meth:`_apply_pens`.
        self.pen_specs = {
            self.theory["float32"]: ("float32", 1, dash), self.theory["16-bit"]: ("16-bit", 1, dash),
            self.theory["int8"]: ("int8", 1, dash), self.allocated_curve: ("allocated", 2, solid),
            self.used_curve: ("used", 3, solid), self.full_curve: ("full", 2, dash),
            self.context_line: ("limit", 1.5, solid),
            self.memory_line: ("limit", 1.5, dot),
        }
        self._apply_pens()

        self.zoom = QCheckBox("Zoom to the conversation")
        self.zoom.setToolTip("On: the chart spans twice the tokens used so far (at least 128, at most the context); "
                             "off: the whole context, with both limits")
        self.zoom.setChecked(True)   # a short chat is a sliver of an 8k context: show it growing
        self.zoom.toggled.connect(self.redraw)
        self.readout = QLabel()
        self.readout.setObjectName("kvReadout")
        self.readout.setWordWrap(True)
        self.readout.setTextFormat(Qt.TextFormat.RichText)
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.zoom)
        layout.addWidget(self.readout)
        self._recolor()
        self.redraw()

    # ---- inputs ---------------------------------------------------------------------------
    def on_model(self, info: dict | None) -> None:
        """A model was loaded: new shape, new lines; the old conversation's data goes."""
        self.model = info
        self.series = KVSeries()
        self.remote_stats = None
        self.other_model = False
        self.last_reply = None
        self.plot.setVisible(not self.remote)
        self.zoom.setVisible(not self.remote)
        self.redraw()

    @property
    def remote(self) -> bool:
        """A server's model: it keeps its cache, so there is no chart, only what it reports."""
        return bool(self.model and self.model.get("remote"))

    def on_conversation(self, stats: dict | None) -> None:
        """Another conversation is open, a model loaded or the cache settings changed: its last
        reply's stats (None or ``{}``: no reply yet; ``{"other_model": True}``: its replies came
        from another model, so the cache is empty; ``"stale": True``: no cache of it exists now
        (an earlier run, or other cache settings), so the chart shows the current settings and
        the readout gives these figures as the last reply's), as the status bar shows them."""
        self.series = KVSeries()
        self.other_model = bool(stats and stats.get("other_model"))
        stats = None if self.other_model else stats
        self.last_reply = stats if stats and stats.get("stale") and not self.remote else None
        self.remote_stats = stats or None
        if stats and not self.remote and not self.last_reply:
            self.series.add(stats, self._setting("generation/overflow", "truncate-middle"))
        self.redraw()

    def on_stats(self, stats: dict) -> None:
        """Record a stats dict; the chart follows within :data:`REDRAW_MS`."""
        self.other_model = False
        self.last_reply = None
        if self.remote:
            self.remote_stats = stats
        else:
            self.series.add(stats, self._setting("generation/overflow", "truncate-middle"))
        # The words now, as the status bar's (on the timer they lagged it 4 tokens on X); the chart in REDRAW_MS.
        self.readout.setText(self._readout())
        self._dirty = True
        if not self._timer.isActive():
            self._timer.start()

    def flush(self) -> None:
        """Draw what was recorded now (a reply ended: its last figures, as the status bar shows
        them at once, not up to :data:`REDRAW_MS` later)."""
        if self._dirty:
            self.redraw()

    def on_setting(self, key: str, value) -> None:
        """A setting changed: the limits and the policy sentence before a reply follow it."""
        if key.startswith("generation/"):
            self.redraw()

    def _tick(self) -> None:
        if self._dirty:
            self.redraw()
        else:
            self._timer.stop()

    def _setting(self, key: str, default):
        return self.settings.get(key) if self.settings is not None else default

    # ---- figures ----------------------------------------------------------------------------
    def _base(self) -> int:
        """2 x layers x KV heads x head dim (bytes per token = this x bytes per element); 0 if unknown."""
        m = self.model
        if m and all(k in m for k in ("n_layers", "n_kv_heads", "head_dim")):
            return 2 * int(m["n_layers"]) * int(m["n_kv_heads"]) * int(m["head_dim"])
        s = self.series
        if s.bytes_per_token and s.dtype in runtime.CACHE_DTYPES and s.dtype != "int8":
            return s.bytes_per_token // runtime.element_bytes(s.dtype)
        return 0

    def _int8_bytes_per_token(self) -> int:
        """An int8 cache's bytes per token (codes and one float32 scale per vector); 0 if unknown."""
        m = self.model
        if m and all(k in m for k in ("n_layers", "n_kv_heads", "head_dim")):
            return runtime.cache_bytes_per_token(int(m["n_layers"]), int(m["n_kv_heads"]), int(m["head_dim"]), "int8")
        s = self.series
        return s.bytes_per_token if s.dtype == "int8" else 0

    def context_limit(self) -> int:
        """The context the chart spans: the last reply's (its session's, capped by its cache
        limit), else what the settings give a new one (:func:`effective_context`, as the
        status bar shows)."""
        if self.series.context_limit:
            return self.series.context_limit
        if self.context_fn is not None:
            return self.context_fn()
        return effective_context({k: self._setting(k, DEFAULTS[k]) for k in CONTEXT_KEYS}, self.model)

    def limit_bytes(self) -> int | None:
        if self.series.now() is not None:
            return self.series.limit_bytes
        mib = float(self._setting("generation/cache_limit_mib", 0.0) or 0.0)
        return int(mib * MIB) if mib > 0 else None

    def theoretical(self) -> dict[str, int]:
        """Bytes per token of each cache dtype for this model (16-bit dtypes share one line)."""
        base, int8 = self._base(), self._int8_bytes_per_token()
        out = {"float32": base * 4, "16-bit": base * 2} if base else {}
        return out | ({"int8": int8} if int8 else {})

    def theory_curve(self, per_token: int, span: int) -> tuple[list[int], list[float]]:
        """The theoretical line (tokens, MiB) from 0 to ``span`` tokens for ``per_token`` bytes
        per token in every layer: straight, or bent where sliding-window layers stop growing
        (each layer holds ``min(tokens, window)`` tokens)."""
        windows = list((self.model or {}).get("layer_windows") or [])
        if not any(windows):
            return [0, span], [0, per_token * span / MIB]
        per_layer = per_token / len(windows)
        knots = sorted({0, span, *(w for w in windows if w and w < span)})
        return knots, [per_layer * sum(t if not w else min(t, w) for w in windows) / MIB for t in knots]

    # ---- drawing ----------------------------------------------------------------------------
    def redraw(self) -> None:
        self._dirty = False
        self.redraws += 1
        s = self.series
        limit = self.context_limit()
        span = limit or 1024
        if self.zoom.isChecked():
            most = max([*s.tokens, *(p[0] for p in s.pending)], default=0)
            span = min(max(2 * most, ZOOM_MIN_TOKENS), span)
        for key, per_token in self.theoretical().items():
            self.theory[key].setData(*self.theory_curve(per_token, span))
        if not self.theoretical():
            for curve in self.theory.values():
                curve.setData([], [])
        xs, used, allocated = self.plotted()
        self.used_curve.setData(xs, used, connect="finite")
        self.allocated_curve.setData(xs, allocated, connect="finite")
        self._draw_full()
        now = s.now()
        self.now_dot.setData([now[0]] if now else [], [now[1] / MIB] if now else [])
        self.context_line.setVisible(bool(limit))
        if limit:
            self.context_line.setValue(limit)
            self.context_line.label.setFormat(f"context limit {limit:,}")
        mem = self.limit_bytes()
        self.memory_line.setVisible(mem is not None)
        if mem is not None:
            self.memory_line.setValue(mem / MIB)
            self.memory_line.label.setFormat(f"memory limit {mem / MIB:,.1f} MiB")
        self._draw_events()
        item = self.plot.getPlotItem()
        top_bytes = max([max(self.theoretical().values(), default=0) * span, *s.allocated, *s.full,
                         *(p[2] for p in s.pending),
                         (mem or 0) if not self.zoom.isChecked() else 0])
        top_bytes = top_bytes or EMPTY_TOP_BYTES   # nothing to draw yet: 0..1 MiB, not 0..1e-06
        item.setXRange(0, span * 1.02, padding=0)
        item.setYRange(0, top_bytes / MIB * 1.08, padding=0)
        self.place_labels()
        self.readout.setText(self._readout())

    def plotted(self) -> tuple[list[float], list[float], list[float]]:
        """The used and allocated lines as drawn: x tokens, y MiB, a NaN gap where the cache shrank."""
        s = self.series
        xs: list[float] = []
        used: list[float] = []
        allocated: list[float] = []
        points = [*zip(s.tokens, s.used, s.allocated), *s.pending]   # then the prompt being read
        for i, (t, u, a) in enumerate(points):
            if i and t < points[i - 1][0]:
                xs.append(float("nan"))
                used.append(float("nan"))
                allocated.append(float("nan"))
            xs.append(float(t))
            used.append(u / MIB)
            allocated.append(a / MIB)
        return xs, used, allocated

    def _draw_full(self) -> None:
        """The full cache's line (what the conversation would take without eviction) while a
        cache policy has evicted tokens; the legend names it then, and the used line 'kept'."""
        s = self.series
        on = s.evicting
        self.full_curve.setData([float(t) for t in s.tokens] if on else [], [f / MIB for f in s.full] if on else [])
        names = [label.text for _, label in self.legend.items]
        if on and "full cache" not in names:
            self.legend.addItem(self.full_curve, "full cache")
            self._rename(self.used_curve, "kept")
            self._recolor()
        elif not on and "full cache" in names:
            self.legend.removeItem(self.full_curve)
            self._rename(self.used_curve, "used")

    def _rename(self, curve, name: str) -> None:
        for sample, label in self.legend.items:
            if sample.item is curve:
                label.setText(name)

    def _draw_events(self) -> None:
        item = self.plot.getPlotItem()
        for it in self.event_items:
            item.removeItem(it)
        self.event_items = []
        for before, after, kind in self.series.events[-20:]:
            line = pg.InfiniteLine(pos=before, angle=90, pen=self._pen("event", 1, Qt.PenStyle.DashLine),
                                   label=f"{kind} {before - after:,}",
                                   labelOpts={"position": 0.25, "color": COLORS["event"], "rotateAxis": (1, 0)})
            line.kv_event = (before, after, kind)   # not .event: that is QObject.event()
            item.addItem(line, ignoreBounds=True)
            self.event_items.append(line)

    def place_labels(self) -> None:
        """Lay the line labels out, none over another or past an edge (:func:`labels.lay_out`)."""
        labels.lay_out(self.plot.getPlotItem().vb, self.memory_line, self.context_line, self.event_items)

    def _readout(self) -> str:
        if self.remote:
            return f"{REMOTE_KV_NOTE}<br>{OTHER_MODEL if self.other_model else usage_text(self.remote_stats)}"
        s, limit, mem = self.series, self.context_limit(), self.limit_bytes()
        now = s.now()
        if now is None:
            return readout.before_a_cache(model=self.model, other_model=self.other_model, last_reply=self.last_reply,
                                          per_token=self.theoretical(), limit=limit, limit_bytes=mem,
                                          next_dtype=self._next_dtype())
        policy = self._setting("generation/overflow", "truncate-middle")
        sinks = int(self._setting("generation/sink_tokens", 4))
        system = s.sink_tokens > sinks   # the last reply's sinks reached past the setting: the system prompt's
        policy_line = policy_next(policy, now[0], limit, max(sinks, s.sink_tokens), system) if limit else ""
        try:
            cache_policy = self._setting("generation/cache_policy", "none")
        except KeyError:   # a settings object without the key (older files are read with defaults)
            cache_policy = "none"
        if s.evicting or cache_policy != "none":
            policy_line = readout.kept_line(s, cache_policy) + ("<br>" + policy_line if policy_line else "")
        return readout.figures(s, limit, mem, window_note=readout.window_note(self.model, s.bytes_per_token),
                               policy_line=policy_line, event_color=COLORS["event"])

    def _next_dtype(self) -> str:
        """The cache dtype the next reply gets: the setting (``auto``: the model's default cache dtype)."""
        dtype = str(self._setting("generation/cache_dtype", "auto") or "auto")
        if dtype == "auto":
            m = self.model or {}
            dtype = str(m.get("cache_dtype") or m.get("compute_dtype") or m.get("dtype") or "auto")
        return dtype

    # ---- palette ------------------------------------------------------------------------------
    def _recolor(self) -> None:
        pal = self.palette()
        self.plot.setBackground(pal.color(QPalette.ColorRole.Base))
        text = pal.color(QPalette.ColorRole.Text)
        item = self.plot.getPlotItem()
        for name in ("left", "bottom"):
            axis = item.getAxis(name)
            axis.setTextPen(text)
            axis.setPen(pg.mkPen(QColor(text.red(), text.green(), text.blue(), 140)))
            axis.label.setDefaultTextColor(text)  # the axis title
        for sample, label in self.legend.items:
            label.setText(label.text, color=text)

    # ---- pens at the screen's pixel ratio -------------------------------------------------------
    def _pen(self, color: str, width: float, style: Qt.PenStyle) -> QPen:
        """A pen ``width`` logical pixels wide: pyqtgraph's pens are cosmetic, so their width is
        in device pixels, and at a device pixel ratio of 2 (a 4K screen at 200 %) every line
        was drawn half as thick, its dashes half as long."""
        return pg.mkPen(COLORS[color], width=width * max(self.devicePixelRatioF(), 1.0), style=style)

    def _apply_pens(self) -> None:
        for item, (color, width, style) in self.pen_specs.items():
            item.setPen(self._pen(color, width, style))
        for line in self.event_items:
            line.setPen(self._pen("event", 1, Qt.PenStyle.DashLine))

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._fit_legend()

    def _fit_legend(self) -> None:
        """Two legend columns when the chart has room for them, else one (nothing cut off)."""
        if self.legend.columnCount == 2:   # measured again: fonts and the palette change it
            self._two_column_width = self.plot.getPlotItem().minimumWidth()
        margins = self.layout().contentsMargins()
        room = self.width() - margins.left() - margins.right()
        columns = 2 if room >= self._two_column_width else 1
        if self.legend.columnCount != columns:
            self.legend.setColumnCount(columns)

    def showEvent(self, event) -> None:  # noqa: N802 - the screen it opens on decides the ratio
        super().showEvent(event)
        self._apply_pens()

    def changeEvent(self, event) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self._recolor()
        elif event.type() == QEvent.Type.DevicePixelRatioChange:   # moved to another screen
            self._apply_pens()


def install_kv_panel(window) -> KVPanel:
    """Dock a :class:`KVPanel` on ``window`` (a MainWindow), fed by its model and stats signals."""
    panel = KVPanel(window.settings, context_fn=window.context_limit)
    panel.on_model(window.engine.model)
    window.model_changed.connect(panel.on_model)
    window.stats_updated.connect(panel.on_stats)
    window.reply_finished.connect(lambda *_: panel.flush())
    window.conversation_stats.connect(panel.on_conversation)
    window.settings.changed.connect(panel.on_setting)
    window.add_panel("kvCachePanel", "KV cache", panel)   # as PANEL_SLOTS names it
    return panel
