"""The attention panel's views: live, snapshot and head atlas (the formula's numbers are
in :mod:`desktop.panels.attention.formula`).

Each view takes the plain data the engine sends (numpy arrays, lists, dicts), draws
it, and returns what it shows from ``data()`` (for the .npz export). The heavy work
(masking, re-normalising and pooling a 2,048 x 2,048 matrix) is vectorised numpy.
Must not import torch or runtime.
"""
from __future__ import annotations

import html

import numpy as np
from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox, QGridLayout, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton, QScrollArea, QVBoxLayout, QWidget,
)

from desktop.flow_layout import flow_row
from desktop.panels.attention.widgets import EntropyBars, TokenHeatText, display_token
from desktop.panels.attention.heatmap import SYNC_CELLS, ColorBar, HeatmapWidget, in_background

__all__ = ["AtlasView", "LiveView", "SnapshotView", "entropy_bits", "prepare_matrix", "quote", "reduce_heads", "rich_label"]


def reduce_heads(w: np.ndarray, head) -> np.ndarray:
    """``w (H, ...)`` -> one head's slice, or the ``"mean"`` / ``"max"`` over heads."""
    if head == "mean":
        return w.mean(axis=0)
    if head == "max":
        return w.max(axis=0)
    return w[int(head)]


def entropy_bits(w: np.ndarray) -> np.ndarray:
    """Shannon entropy (bits) of each row of ``w (..., T)`` (rows sum to 1): 0 = one token, log2 T = uniform."""
    w = np.asarray(w, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(w > 0, w * np.log2(np.where(w > 0, w, 1.0)), 0.0)
    return (-terms.sum(axis=-1)).astype(np.float32)


def prepare_matrix(m: np.ndarray, *, hide_first: bool = False, renormalise: bool = False,
                   window: int | None = None) -> np.ndarray:
    """The snapshot's values as drawn, from causal ``(T, T)`` weights (zero above the diagonal):
    ``hide_first`` drops key 0 (the attention sink, Xiao et al. 2023) -> ``(T, T-1)``;
    ``renormalise`` divides each row by its sum over the keys shown (a row with nothing
    left, query 0 without key 0, stays 0). The causal mask is drawn by the heatmap
    (``causal=1`` with ``hide_first``, else 0), not stored here: one pass over 4 million cells.
    ``window`` (a sliding layer's, in tokens): the keys out of each query's window
    (key ``j <= i - window``) become ``NaN``, drawn masked like the causal triangle."""
    out = np.asarray(m, dtype=np.float32)
    if hide_first:
        out = out[:, 1:]
    if renormalise:
        s = out.sum(axis=1, keepdims=True)
        out = np.divide(out, s, out=np.zeros(out.shape, dtype=np.float32), where=s > 0)
    if window is not None and window < out.shape[0]:
        first = 1 if hide_first else 0
        rows = np.arange(out.shape[0])[:, None]
        keys = np.arange(out.shape[1])[None, :] + first
        out = np.where(keys <= rows - window, np.float32(np.nan), out)  # a new array: m is never written to
    return out


def quote(tok: str) -> str:
    """A token in curly quotes, HTML-escaped, newlines shown (for rich-text labels)."""
    return "“" + html.escape(display_token(tok)) + "”"


def _layer_list(layers: list[int]) -> str:
    """``[0, 1, 2, 4]`` -> ``"0–2, 4"``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs)


def _head_name(head) -> str:
    return {"mean": "mean over heads", "max": "max over heads"}.get(head, f"head {head}")


def rich_label(text: str = "", *, wrap: bool = True, small: bool = False) -> QLabel:
    """A selectable rich-text label (``small``: 90 % of the font size)."""
    lab = QLabel(text)
    lab.setWordWrap(wrap)
    lab.setTextFormat(Qt.TextFormat.RichText)
    lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    if small:
        f = lab.font()
        f.setPointSizeF(f.pointSizeF() * 0.9)
        lab.setFont(f)
    return lab


class LiveView(QWidget):
    """The newest token's attention over the context, as a reply streams."""

    head_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.frame: dict | None = None
        self.layer, self.head = 0, "mean"
        self.caption = rich_label("The newest token's attention appears here while a reply is written.")
        self.heads = HeatmapWidget(min_size=QSize(120, 48))
        self.heads.set_axes(rows=True, cols=True)
        self.heads.setToolTip("Every head of the layer (rows) over the context (columns); each row scaled to its maximum")
        self.strip = HeatmapWidget(min_size=QSize(120, 14))
        self.strip.setFixedHeight(16)
        self.text = TokenHeatText()
        self.text.setProperty("placeholder", "The conversation's tokens, shaded by attention")
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setWidget(self.text)
        self.scroll.setMinimumHeight(64)
        self.entropy = EntropyBars()
        self.readout = rich_label("", small=True)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(self.caption)
        lay.addWidget(rich_label("<b>Heads × context</b> (rows: heads; each row scaled to its maximum)", small=True))
        lay.addWidget(self.heads, 2)
        lay.addWidget(rich_label("<b>Chosen head over the context</b>", small=True))
        lay.addWidget(self.strip)
        lay.addWidget(self.readout)
        lay.addWidget(self.scroll, 5)
        lay.addWidget(rich_label("<b>Entropy per head</b> (bits; low = focused; dashed: uniform)", small=True))
        lay.addWidget(self.entropy)
        self.heads.hovered.connect(lambda h, k: self._hover(k, h))
        self.strip.hovered.connect(lambda _r, k: self._hover(k))
        self.text.hovered.connect(self._hover)
        self.heads.clicked.connect(lambda h, _k: self.head_clicked.emit(h))
        self.entropy.clicked.connect(self.head_clicked)

    def set_frame(self, frame: dict | None) -> None:
        self.frame = frame
        self.refresh()

    def set_selection(self, layer: int, head) -> None:
        self.layer, self.head = layer, head
        self.refresh()

    def row(self) -> np.ndarray | None:
        """The chosen head's (or reduction's) weights over the context, ``(Tk,)``."""
        if self.frame is None or self.layer >= self.frame["weights"].shape[0]:
            return None
        return reduce_heads(self.frame["weights"][self.layer], self.head)

    def refresh(self) -> None:
        row = self.row()
        if row is None:
            return
        w = self.frame["weights"][self.layer]  # (H, Tk)
        tokens = self.frame["tokens"]
        T = len(tokens)
        peak = np.maximum(w.max(axis=1, keepdims=True), 1e-12)
        self.heads.set_values(w / peak, vmax=1.0)
        self.strip.min_left = self.heads.margins()[0]
        head_idx = None if self.head in ("mean", "max") else int(self.head)
        self.heads.set_selection(row=head_idx)
        self.strip.set_values(row[None, :], vmax=float(row.max()) or 1.0)
        self.text.set_tokens(tokens)
        bar = self.scroll.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        self.text.set_weights(row, marked=T - 1)
        kept = self.kept()
        self.text.set_kept(kept)
        if at_end:
            bar.setValue(bar.maximum())
        self.entropy.set_values(entropy_bits(w), np.log2(max(T, 2)), head_idx)
        top = np.argsort(row)[::-1][:4]
        looks = ", ".join(f"{quote(tokens[i])} #{i} {row[i]:.2f}" for i in top)
        state = "" if self.frame.get("final") else " (streaming)"
        self.caption.setText(f"Newest token {quote(tokens[-1])} (#{T - 1}) · layer {self.layer} · "
                             f"{_head_name(self.head)}{state}<br>Looks most at: {looks}" + self.evicted_text())

    def kept(self) -> np.ndarray | None:
        """``(Tk,)``: the share of this layer's KV heads still holding each token (None: no eviction)."""
        k = self.frame.get("kept") if self.frame else None
        return None if k is None or self.layer >= k.shape[0] else k[self.layer]

    def evicted_text(self) -> str:
        """``"<br>Layer 3 evicted 812 of 1,100 tokens (h2o), greyed; 40 more by some of its heads."``"""
        k = self.kept()
        if k is None:
            return ""
        gone, some = int((k <= 0).sum()), int(((k > 0) & (k < 1)).sum())
        policy = self.frame.get("cache_policy") or "a cache policy"
        if not gone and not some:
            return f"<br>Layer {self.layer} has evicted nothing ({policy})."
        more = f"; {some:,} more by some of its heads (grey text)" if some else ""
        return (f"<br>Layer {self.layer} evicted {gone:,} of {len(k):,} tokens ({policy}), greyed: the model no "
                f"longer sees them{more}.")

    def _hover(self, k: int, h: int | None = None) -> None:
        row = self.row()
        if row is None or k < 0 or k >= len(row):
            self.readout.setText("")
            return
        tokens = self.frame["tokens"]
        if h is not None and h >= 0:
            wt, who = self.frame["weights"][self.layer][h][k], f"head {h}"
        else:
            wt, who = row[k], _head_name(self.head)
        kept = self.kept()
        gone = "" if kept is None or kept[k] >= 1 else (
            "; evicted by this layer" if kept[k] <= 0 else f"; kept by {kept[k]:.0%} of this layer's heads")
        self.readout.setText(f"key #{k} {quote(tokens[k])}: weight {wt:.4f} ({who}){gone}")

    def data(self) -> dict:
        if self.frame is None:
            return {}
        w = self.frame["weights"][self.layer]
        out = {"view": "live", "layer": self.layer, "head": str(self.head), "weights": w, "row": self.row(),
               "entropy_bits": entropy_bits(w), "tokens": np.array(self.frame["tokens"], dtype=object).astype(str)}
        if self.kept() is not None:
            out["kept"] = self.kept()
        return out


class SnapshotView(QWidget):
    """One layer's and head's full token-by-token matrix for the conversation."""

    refresh_requested = Signal()
    query_clicked = Signal(int)   # a position in the conversation

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.snap: dict | None = None          # what is drawn
        self.shown: np.ndarray | None = None    # its values as drawn (options applied)
        self._latest: dict | None = None        # what was last given (drawn once prepared)
        self._opts = (False, False)             # (hide first, re-normalise) of what is drawn
        self._job = 0
        self.refresh_button = QPushButton("Refresh")
        self.hide_first = QCheckBox("Hide first token")
        self.hide_first.setToolTip("Leave out key 0: most heads park attention there (an attention sink)")
        self.renormalise = QCheckBox("Re-normalise rows")
        self.renormalise.setToolTip("Divide each row by its sum over the keys shown")
        self.sqrt = QCheckBox("√ colour")
        self.sqrt.setToolTip("Colour by the square root of the weight, so small weights show")
        self.caption = rich_label("Open a conversation: its full attention matrix appears here.")
        self.heat = HeatmapWidget(square=True, min_size=QSize(160, 160))
        self.heat.setProperty("placeholder", "No snapshot yet")
        self.heat.set_axes(rows=True, cols=True)
        self.scale = ColorBar()
        self.readout = rich_label("Hover: query token, key token and weight. Click a row to explain it.", small=True)
        opts = flow_row(self.hide_first, self.renormalise, self.sqrt, self.refresh_button)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(opts)
        lay.addWidget(self.caption)
        lay.addWidget(self.heat, 1)
        lay.addWidget(self.scale)
        lay.addWidget(self.readout)
        for box in (self.hide_first, self.renormalise, self.sqrt):
            box.toggled.connect(self.rebuild)
        self.refresh_button.clicked.connect(self.refresh_requested)
        self.heat.hovered.connect(self._hover)
        self.heat.clicked.connect(lambda i, _j: self.snap and self.query_clicked.emit(self.snap["offset"] + i))

    def set_snapshot(self, snap: dict) -> None:
        """Show ``snap`` (the engine's dict); a large one is prepared off the GUI thread, and the
        previous one stays (and hovers correctly) until it is ready."""
        self._latest = snap
        self.rebuild()

    def rebuild(self) -> None:
        s = self._latest
        if s is None:
            return
        self._job += 1
        job, opts = self._job, (self.hide_first.isChecked(), self.renormalise.isChecked())

        def prepare():
            shown = prepare_matrix(s["matrix"], hide_first=opts[0], renormalise=opts[1], window=s.get("window"))
            return shown, (float(np.nanmax(shown)) if shown.size else 0.0) or 1.0

        if s["matrix"].size <= SYNC_CELLS:
            self._show(job, s, opts, prepare())
        else:
            in_background(prepare, lambda result: self._show(job, s, opts, result))

    def _show(self, job: int, s: dict, opts: tuple[bool, bool], result: tuple[np.ndarray, float]) -> None:
        if job != self._job:
            return   # options or data changed since: a newer job follows
        self.snap, self._opts = s, opts
        self.shown, vmax = result
        first = 1 if opts[0] else 0
        gamma = 0.5 if self.sqrt.isChecked() else 1.0
        self.heat.set_axes(rows=True, cols=True, row_offset=s["offset"], col_offset=s["offset"] + first)
        self.heat.set_values(self.shown, vmax=vmax, gamma=gamma, causal=first)
        self.scale.set_scale(vmax, gamma, "re-normalised weight" if opts[1] else "weight")
        T = s["matrix"].shape[0]
        part = f"the last {T:,} of {s['total']:,} tokens" if s["offset"] else f"{T:,} tokens"
        slides = f"; this layer slides: each token sees the {s['window']:,} newest" if s.get("window") else ""
        self.caption.setText(f"Layer {s['layer']} · {_head_name(s['head'])} · {part} "
                             f"(rows: query tokens, columns: key tokens; grey: masked{slides})")

    def _hover(self, i: int, j: int) -> None:
        s = self.snap
        if s is None or i < 0:
            self.readout.setText("")
            return
        k = j + (1 if self._opts[0] else 0)
        tok, off = s["tokens"], s["offset"]
        head = f"query #{off + i} {quote(tok[i])} → key #{off + k} {quote(tok[k])}: "
        if k > i:
            self.readout.setText(head + "masked (a token never sees later tokens)")
            return
        if s.get("window") and k <= i - s["window"]:
            self.readout.setText(head + f"masked (out of this layer's {s['window']:,}-token window)")
            return
        extra = f" (re-normalised {self.shown[i, j]:.4f})" if self._opts[1] else ""
        self.readout.setText(head + f"weight {s['matrix'][i, k]:.4f}{extra}")

    def data(self) -> dict:
        s = self.snap
        if s is None:
            return {}
        return {"view": "snapshot", "layer": s["layer"], "head": str(s["head"]), "matrix": s["matrix"],
                "shown": self.shown, "offset": s["offset"], "hide_first": self._opts[0],
                "renormalise": self._opts[1], "tokens": np.array(s["tokens"], dtype=object).astype(str)}


class AtlasView(QWidget):
    """Every head's previous-token and induction score (Olsson et al. 2022), and the top heads."""

    measure_requested = Signal()
    head_clicked = Signal(int, int)
    TOP = 5

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.scores: dict | None = None
        self.measure_button = QPushButton("Measure heads")
        self.caption = rich_label(self.CAPTION)
        self.grids = {k: HeatmapWidget(min_size=QSize(60, 120)) for k in ("previous_token", "induction")}
        self.readout = rich_label("", small=True)
        self.scale = ColorBar()
        self.scale.set_scale(1.0, title="score")
        self.top = QListWidget()
        self.top.setMinimumHeight(60)
        grid = QGridLayout()
        for col, (kind, title) in enumerate((("previous_token", "Previous-token"), ("induction", "Induction"))):
            grid.addWidget(rich_label(f"<b>{title}</b> (rows: layers, columns: heads)", small=True), 0, col)
            grid.addWidget(self.grids[kind], 1, col)
            self.grids[kind].setProperty("placeholder", "not measured yet")
            self.grids[kind].set_axes(rows=True, cols=True)
            self.grids[kind].hovered.connect(lambda l, h, k=kind: self._hover(k, l, h))
            self.grids[kind].clicked.connect(self.head_clicked)
        grid.setRowStretch(1, 1)
        head = QHBoxLayout()
        head.addWidget(self.caption, 1)
        head.addWidget(self.measure_button, 0, Qt.AlignmentFlag.AlignTop)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addLayout(head)
        lay.addLayout(grid, 3)
        lay.addWidget(self.scale)
        lay.addWidget(self.readout)
        lay.addWidget(rich_label("<b>Top heads</b>", small=True))
        lay.addWidget(self.top, 1)
        self.measure_button.clicked.connect(self.measure_requested)
        self.top.itemClicked.connect(lambda it: self.head_clicked.emit(*it.data(Qt.ItemDataRole.UserRole)))

    def set_scores(self, scores: dict) -> None:
        self.scores = scores
        for kind, w in self.grids.items():
            w.set_values(scores[kind], vmax=1.0)
        self.top.clear()
        for kind, name in (("induction", "induction"), ("previous_token", "previous-token")):
            for l, h, v in self.top_heads(kind, self.TOP):
                it = QListWidgetItem(f"L{l}.H{h}  {name}  {v:.3f}")
                it.setData(Qt.ItemDataRole.UserRole, (l, h))
                self.top.addItem(it)
        blind = [i for i, w in enumerate(scores.get("windows") or ()) if w is not None and w <= scores["repeat_len"]]
        note = (f" Layers {_layer_list(blind)} slide with a window shorter than one copy: they cannot score "
                "induction." if blind else "")
        self.caption.setText(f"{scores['model']}: mean attention over {scores['batch']} sequences of "
                             f"{scores['repeat_len']} random tokens repeated twice (Olsson et al. 2022).{note} "
                             "Click a head to choose it.")

    CAPTION = "Each head's score on random tokens repeated twice (Olsson et al. 2022). Click a head to choose it."

    def clear(self) -> None:
        """No scores: another model was loaded (its heads are not these)."""
        self.scores = None
        for w in self.grids.values():
            w.set_values(None)
        self.top.clear()
        self.caption.setText(self.CAPTION)

    def top_heads(self, kind: str, n: int) -> list[tuple[int, int, float]]:
        """The ``n`` best heads for ``kind`` (``"induction"`` or ``"previous_token"``): (layer, head, score)."""
        if self.scores is None:
            return []
        a = self.scores[kind]
        best = np.argsort(a, axis=None, kind="stable")[::-1][:n]
        return [(int(l), int(h), float(a[l, h])) for l, h in zip(*np.unravel_index(best, a.shape))]

    def set_selection(self, layer: int, head) -> None:
        for w in self.grids.values():
            w.set_selection(row=layer, col=None if head in ("mean", "max") else int(head))

    def _hover(self, kind: str, l: int, h: int) -> None:
        if self.scores is None or l < 0:
            self.readout.setText("")
            return
        s = self.scores
        self.readout.setText(f"L{l}.H{h}: previous-token {s['previous_token'][l, h]:.3f}, "
                             f"induction {s['induction'][l, h]:.3f}")

    def data(self) -> dict:
        if self.scores is None:
            return {}
        s = self.scores
        return {"view": "atlas", "induction": s["induction"], "previous_token": s["previous_token"],
                "repeat_len": s["repeat_len"], "batch": s["batch"]}
