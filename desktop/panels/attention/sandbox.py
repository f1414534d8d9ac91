"""Two views a learner drives without a model: the formula by hand, and why divide by √d_k.

- :class:`SandboxView`: keys, values and a query typed in (default: the material's three
  tokens "the cat sat"), each step of ``softmax(q·k/√d_k)·v`` shown; the weights can be
  hidden, the winner guessed, then revealed. The numbers are :func:`formula_by_hand`,
  numpy's twin of ``runtime.insight.formula.formula_by_hand`` (``attnchat formula``; the tests
  check they agree): widgets never import torch.
- :class:`ScaleView`: the spread of ``q·k`` for random unit-variance vectors grows as
  √d (1.4 for d = 2, 8 for 64, 23 for 512), and a softmax over unscaled scores
  collapses onto one key; scaling keeps its entropy. Simulated with a seeded numpy
  generator for the d the user picks and the loaded model's head size.

Must not import torch or runtime.
"""
from __future__ import annotations

import html
import math

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView, QCheckBox, QComboBox, QFormLayout, QFrame, QLineEdit, QPushButton, QScrollArea,
    QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from desktop.flow_layout import flow_row, labelled
from desktop.panels.attention.views import rich_label
from desktop.widgets.fit_rows import fit_rows, whole_columns

__all__ = ["SandboxView", "ScaleView", "formula_by_hand", "parse_vectors", "scale_simulation"]

EXAMPLE = {"tokens": "the cat sat", "q": "2,0", "k": "0,1  2,0  1,1", "v": "1,0  0,1  1,1"}


def parse_vectors(text: str, what: str) -> list[list[float]]:
    """``"0,1  2,0"`` -> ``[[0, 1], [2, 0]]`` (vectors separated by spaces, numbers by commas).

    Raises:
        ValueError: a part that is not finite numbers separated by commas.
    """
    out = []
    for part in text.split():
        try:
            vec = [float(x) for x in part.split(",")]
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a vector; write numbers separated by commas, e.g. 1,0") from None
        if not all(math.isfinite(x) for x in vec):
            raise ValueError(f"{what}: {part!r} holds a number that is not finite")
        out.append(vec)
    if not out:
        raise ValueError(f"{what}: type at least one vector, e.g. 1,0")
    return out


def formula_by_hand(q, keys, values, *, scale: bool = True, causal_at: int | None = None) -> dict:
    """``softmax(q·k/√d_k)·v`` step by step in float64 (as ``runtime.insight.formula.formula_by_hand``).

    Returns:
        ``{"scores", "scaled", "weights", "output", "masked", "scale", "d_k"}``: lists over
        the keys (masked keys: weight 0), the output over the value dimensions.

    Raises:
        ValueError: ragged vectors, as many values as keys not given, ``causal_at`` outside the keys.
    """
    d = len(q)
    if d == 0 or not keys or any(len(k) != d for k in keys):
        raise ValueError(f"every key needs {d} numbers, as the query has")
    if len(values) != len(keys):
        raise ValueError(f"give one value per key: {len(keys)} keys but {len(values)} values")
    if any(len(v) != len(values[0]) for v in values):
        raise ValueError("every value needs the same number of numbers")
    n = len(keys)
    if causal_at is not None and not 0 <= causal_at < n:
        raise ValueError(f"the query's position {causal_at} is outside the keys 0..{n - 1}")
    K, V, qv = np.asarray(keys, np.float64), np.asarray(values, np.float64), np.asarray(q, np.float64)
    s = 1.0 / math.sqrt(d) if scale else 1.0
    scores = K @ qv
    scaled = scores * s
    masked = np.zeros(n, bool)
    if causal_at is not None:
        masked[causal_at + 1:] = True
    z = np.where(masked, -np.inf, scaled)
    e = np.exp(z - z.max())
    w = e / e.sum()
    return {"scores": scores.tolist(), "scaled": scaled.tolist(), "weights": w.tolist(), "output": (w @ V).tolist(),
            "masked": masked.tolist(), "scale": s, "d_k": d}


def _vec(xs) -> str:
    return "(" + ", ".join(f"{x:g}" for x in xs) + ")"


class SandboxView(QWidget):
    """The formula by hand, with predict-then-reveal (see the module docstring)."""

    COLUMNS = ("token", "k", "v", "q·k", "÷√d", "weight")
    #: Rows the table keeps in view before it scrolls inside; the view scrolls when the panel is
    #: shorter than that (the texts above took the height: one row of three showed at 720 px).
    TABLE_ROWS = 6

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("sandbox")
        self.result: dict | None = None
        self.tokens = QLineEdit(EXAMPLE["tokens"])
        self.q = QLineEdit(EXAMPLE["q"])
        self.k = QLineEdit(EXAMPLE["k"])
        self.v = QLineEdit(EXAMPLE["v"])
        self.scale = QCheckBox("Divide by √d_k")
        self.scale.setChecked(True)
        self.causal = QCheckBox("Causal: query at token")
        self.causal.setToolTip("A causal mask: the query at this token sees only the keys up to it")
        self.causal_at = QSpinBox()
        self.causal_at.setRange(0, 0)
        self.hide = QCheckBox("Hide the weights (guess first)")
        self.guess = QComboBox()
        self.reveal = QPushButton("Reveal")
        self.reset = QPushButton("Example")
        self.table = QTableWidget(0, len(self.COLUMNS))
        self.table.setHorizontalHeaderLabels(list(self.COLUMNS))
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        whole_columns(self.table)   # stretched, "÷√d_k" and "weight" were cut in the 285 px dock
        self.output = rich_label("")
        self.verdict = rich_label("", small=True)
        form = QFormLayout()
        form.addRow("Tokens", self.tokens)
        form.addRow("Query q", self.q)
        form.addRow("Keys K", self.k)
        form.addRow("Values V", self.v)
        opts = flow_row(self.scale, self.causal, self.causal_at, self.reset)
        guess = flow_row(self.hide, labelled("My guess:", self.guess), self.reveal)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        body = QWidget()
        lay = QVBoxLayout(body)
        # No right margin: the view's scroll bar takes that side, and beside it, at the dock's
        # default width (1,100 px), the table's six columns were 8 px wider than its view.
        lay.setContentsMargins(4, 6, 0, 6)
        lay.addWidget(rich_label("Type a query, keys and values (numbers separated by commas, vectors by spaces); "
                                 "work out the weights yourself, then compare.", small=True))
        lay.addLayout(form)
        lay.addLayout(opts)
        lay.addLayout(guess)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.output)
        lay.addWidget(self.verdict)
        lay.addStretch(1)   # a tall panel's room goes below, not between the rows above
        self.scroll.setWidget(body)
        for w in (self.tokens, self.q, self.k, self.v):
            w.textChanged.connect(self.recompute)
        for w in (self.scale, self.causal, self.hide):
            w.toggled.connect(self.recompute)
        self.causal_at.valueChanged.connect(self.recompute)
        self.reveal.clicked.connect(self.do_reveal)
        self.reset.clicked.connect(self.load_example)
        self.recompute()

    def load_example(self) -> None:
        for w, key in ((self.tokens, "tokens"), (self.q, "q"), (self.k, "k"), (self.v, "v")):
            w.setText(EXAMPLE[key])

    def _labels(self, n: int) -> list[str]:
        words = self.tokens.text().split()
        return [words[i] if i < len(words) else f"#{i}" for i in range(n)]

    def recompute(self, *_) -> None:
        """Parse the fields and show every step (or one line saying what is wrong)."""
        try:
            q = parse_vectors(self.q.text(), "Query")
            if len(q) != 1:
                raise ValueError("Query: type one vector, e.g. 2,0")
            keys = parse_vectors(self.k.text(), "Keys")
            values = parse_vectors(self.v.text(), "Values")
            self.causal_at.blockSignals(True)
            self.causal_at.setRange(0, max(len(keys) - 1, 0))
            self.causal_at.blockSignals(False)
            r = formula_by_hand(q[0], keys, values, scale=self.scale.isChecked(),
                                causal_at=self.causal_at.value() if self.causal.isChecked() else None)
        except ValueError as e:
            self.result = None
            self.table.setRowCount(0)
            self.output.setText(f"<span style='color:#c0392b'>{html.escape(str(e), quote=False)}</span>")
            self.verdict.setText("")
            return
        r.update(q=q[0], keys=keys, values=values, tokens=self._labels(len(keys)))
        self.result = r
        hidden = self.hide.isChecked()
        labels = r["tokens"]
        keep = self.guess.currentIndex()
        self.guess.blockSignals(True)
        self.guess.clear()
        self.guess.addItems([f"{labels[j]} wins" for j in range(len(keys))])
        self.guess.setCurrentIndex(min(max(keep, 0), len(keys) - 1))
        self.guess.blockSignals(False)
        self.table.setRowCount(len(keys))
        for j in range(len(keys)):
            masked = r["masked"][j]
            cells = (labels[j], _vec(keys[j]), _vec(values[j]), f"{r['scores'][j]:.3f}", f"{r['scaled'][j]:.3f}",
                     "masked" if masked else "?" if hidden else f"{r['weights'][j]:.3f}")
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c >= 3:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(j, c, item)
        self._keep_rows_in_view()
        d = r["d_k"]
        how = f"÷ √{d} = × {r['scale']:.3f}" if self.scale.isChecked() else "not scaled"
        self.table.horizontalHeaderItem(4).setText("÷√d" if self.scale.isChecked() else "no ÷")
        out = "?" if hidden else _vec(round(x, 3) for x in r["output"])
        self.output.setText(f"d_k = {d}, scores {how}. Output = Σ<sub>j</sub> w<sub>j</sub> v<sub>j</sub> = <b>{out}</b>")
        self.reveal.setEnabled(hidden)
        self.verdict.setText("" if hidden else "Hide the weights to guess the winner before you see them.")

    def _keep_rows_in_view(self) -> None:
        """The table at least as tall as its first :data:`TABLE_ROWS` rows (and its header, and
        a sideways scroll bar's room), so a short panel scrolls the view rather than the rows;
        at most as tall as all of them, so a tall one leaves no empty rows above the output."""
        t = self.table
        rest = t.horizontalHeader().sizeHint().height() + 2 * t.frameWidth() + t.horizontalScrollBar().sizeHint().height()
        heights = [t.rowHeight(r) for r in range(t.rowCount())]
        t.setMinimumHeight(rest + sum(heights[:self.TABLE_ROWS]))
        t.setMaximumHeight(rest + sum(heights))

    def do_reveal(self) -> None:
        """Show the weights and say whether the guessed key is the heaviest."""
        if self.result is None:
            return
        guess = self.guess.currentIndex()
        self.hide.setChecked(False)  # recomputes, showing the weights
        w, labels = self.result["weights"], self.result["tokens"]
        win = int(np.argmax(w))
        if guess == win:
            text = f"Right: “{html.escape(labels[win])}” wins with weight {w[win]:.3f}."
        else:
            text = (f"Not quite: “{html.escape(labels[win])}” wins with {w[win]:.3f}; "
                    f"“{html.escape(labels[guess])}” gets {w[guess]:.3f}.")
        self.verdict.setText(text)

    def data(self) -> dict:
        r = self.result
        if r is None:
            return {}
        return {k: np.asarray(r[k]) for k in ("q", "keys", "values", "scores", "scaled", "weights", "output", "masked")}


def scale_simulation(d: int, *, samples: int = 4000, n_keys: int = 32, seed: int = 0) -> dict:
    """Dot products of random unit-variance vectors, with and without the 1/√d scale.

    Args:
        d: the vectors' length (the head size d_k).
        samples: (q, k) pairs drawn for the spread; rows of ``n_keys`` keys for the entropy.
        seed: numpy's generator seed.

    Returns:
        ``{"d", "spread"}`` (the standard deviation of ``q·k``; √d in theory: a sum of d
        products of unit variance), ``"entropy_scaled"`` / ``"entropy_unscaled"`` (mean
        softmax entropy of a row of ``n_keys`` scores, bits; ``log2 n_keys`` is uniform),
        ``"max_weight_scaled"`` / ``"max_weight_unscaled"`` (mean largest weight).
    """
    rng = np.random.default_rng(seed)
    rows = max(samples // n_keys, 1)
    q = rng.standard_normal((rows, 1, d))
    k = rng.standard_normal((rows, n_keys, d))
    s = (q * k).sum(-1)  # (rows, n_keys)
    out = {"d": d, "spread": float(s.std()), "n_keys": n_keys, "uniform_bits": math.log2(n_keys)}
    for name, z in (("scaled", s / math.sqrt(d)), ("unscaled", s)):
        z = z - z.max(-1, keepdims=True)
        w = np.exp(z)
        w /= w.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(w > 0, w * np.log2(np.where(w > 0, w, 1)), 0).sum(-1)
        out[f"entropy_{name}"] = float(ent.mean())
        out[f"max_weight_{name}"] = float(w.max(-1).mean())
    return out


class ScaleView(QWidget):
    """Why divide by √d_k: a live simulation (see the module docstring)."""

    # Units in the headers, the row's note on a line of its own, and √d in the spread's header
    # (a column of its own repeated what the spread shows): in the 310 px dock "4.41 bits",
    # "128 (yours)" and "top weight" were cut.
    COLUMNS = ("d", "spread\nof q·k\n(≈ √d)", "bits\n÷√d", "bits\nno √d", "top\nweight\nno √d")
    TIPS = ("the head size", "the standard deviation of q·k over random q and k (about √d)",
            "the softmax's entropy in bits with the scores divided by √d (uniform: log2 of the keys)",
            "the softmax's entropy in bits without the division", "the largest softmax weight without the division")
    FIXED = (2, 64, 512)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("scale")
        self.head_dim: int | None = None
        self.seed = 0
        self.rows: list[dict] = []
        self.d = QSpinBox()
        self.d.setRange(1, 4096)
        self.d.setValue(128)
        self.d.setPrefix("d = ")
        self.again = QPushButton("Draw again")
        self.table = QTableWidget(0, len(self.COLUMNS))
        self.table.setHorizontalHeaderLabels(list(self.COLUMNS))
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        for c, tip in enumerate(self.TIPS):
            self.table.horizontalHeaderItem(c).setToolTip(tip)
        whole_columns(self.table)
        self._fit_rows = fit_rows(self.table)
        self.explanation = rich_label("", small=True)
        row = flow_row(labelled("Your d:", self.d, stretch=0), self.again)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.addWidget(rich_label("q·k of random vectors whose entries have variance 1: the spread grows as √d, "
                                 "and the softmax of unscaled scores piles onto one key (its entropy, in bits, "
                                 "falls; its top weight nears 1).", small=True))
        lay.addLayout(row)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.explanation)
        self.d.valueChanged.connect(self.refresh)
        self.again.clicked.connect(self._again)
        self.refresh()

    def set_head_dim(self, head_dim: int | None) -> None:
        """The loaded model's head size (a row of its own), or None."""
        self.head_dim = int(head_dim) if head_dim else None
        self.refresh()

    def _again(self) -> None:
        self.seed += 1
        self.refresh()

    def refresh(self, *_) -> None:
        ds = list(self.FIXED) + [self.d.value()] + ([self.head_dim] if self.head_dim else [])
        self.rows = [scale_simulation(d, seed=self.seed) for d in ds]
        self.table.setRowCount(len(ds))
        for i, r in enumerate(self.rows):
            label = f"{r['d']}" + ("\n(yours)" if i == len(self.FIXED) else "\n(model)" if i > len(self.FIXED) else "")
            cells = (label, f"{r['spread']:.1f}", f"{r['entropy_scaled']:.2f}",
                     f"{r['entropy_unscaled']:.2f}", f"{r['max_weight_unscaled']:.2f}")
            for c, text in enumerate(cells):
                self.table.setItem(i, c, QTableWidgetItem(text))
        self._fit_rows()
        mine = self.rows[len(self.FIXED)]
        self.explanation.setText(
            f"With d = {mine['d']} the scores spread about {mine['spread']:.1f} apart, so without scaling the top key "
            f"takes on average {mine['max_weight_unscaled']:.0%} of the weight over {mine['n_keys']} keys "
            f"(entropy {mine['entropy_unscaled']:.2f} of {mine['uniform_bits']:.0f} bits) and the gradient through the "
            f"softmax nearly vanishes; dividing by √d brings the spread back to about 1 "
            f"(entropy {mine['entropy_scaled']:.2f} bits). Seed {self.seed}.")

    def data(self) -> dict:
        if not self.rows:
            return {}
        keys = ("d", "spread", "entropy_scaled", "entropy_unscaled", "max_weight_scaled", "max_weight_unscaled")
        return {k: np.asarray([r[k] for r in self.rows]) for k in keys}
