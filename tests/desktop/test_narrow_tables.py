"""Tables in narrow panels show their headers and cells whole: the Knock out tab's induction
test, Cost, Why √d and the Formula tab at the attention dock's widths (240 px at the least,
about 285 px in an 1100 x 720 window on X; the widths measured offscreen are X's)."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from desktop.panels.attention.formula import NumbersView  # noqa: E402
from desktop.panels.attention.insight.views import CostView, KnockoutView  # noqa: E402
from desktop.panels.attention.sandbox import ScaleView  # noqa: E402

PRESET = {"baseline_first": 4.61, "baseline_second": 0.93, "heads": [[18, 6], [17, 3], [17, 4], [17, 5], [18, 7]],
          "induction_first": 4.62, "induction_second": 2.41,
          "random_heads": [[[3, 1], [9, 4], [22, 0], [5, 8], [27, 2]], [[1, 1], [2, 2], [3, 3], [4, 4], [5, 5]]],
          "random_first": [4.60, 4.61], "random_second": [0.97, 0.95], "model": "SmolLM2-135M-Instruct.Q4_1",
          "repeat_len": 50, "batch": 4, "seed": 0, "mode": "mean"}


def test_the_induction_tests_table_fits_a_narrow_panel(qtbot):
    """Its header "heads knocked out" was cut to "…nock" and "top induction: 18.6 17.3 …" ran out of its cell."""
    view = KnockoutView()
    qtbot.addWidget(view)
    view.resize(240, 700)
    view.show()
    view.set_preset(PRESET)
    t = view.preset_table
    for width in (240, 300, 240):
        view.resize(width, 700)
        qtbot.waitUntil(lambda: t.viewport().width() > 0, timeout=2000)
        qtbot.wait(50)   # the rows are fitted after the header has stretched its columns
        head = t.horizontalHeader()
        for c in range(t.columnCount()):
            assert head.sectionSize(c) >= head.sectionSizeHint(c), (width, c)
        assert sum(head.sectionSize(c) for c in range(t.columnCount())) <= t.viewport().width()
        for r in range(t.rowCount()):
            assert t.rowHeight(r) >= t.sizeHintForRow(r), (width, r, t.item(r, 0).text())
    assert t.item(1, 0).text() == "top induction: 18.6 17.3 17.4 17.5 18.7"
    assert t.rowHeight(1) > t.rowHeight(0)   # wrapped onto more lines than "none"


def _columns_whole(t) -> None:
    """No column of ``t`` narrower than its header or its widest cell (the header's hint covers
    its text, sizeHintForColumn the cells'), no row shorter than its wrapped text."""
    head = t.horizontalHeader()
    for c in range(t.columnCount()):
        wanted = max(head.sectionSizeHint(c), t.sizeHintForColumn(c))
        assert head.sectionSize(c) >= wanted, (c, t.horizontalHeaderItem(c).text())
    for r in range(t.rowCount()):
        assert t.rowHeight(r) >= t.sizeHintForRow(r), (r, t.item(r, 0).text())


#: The Insight views' width in the attention dock of an 1100 x 720 window on X (the dock about 285 px).
DOCK_VIEW = 275


def _at_widths(qtbot, view, t, widths=(DOCK_VIEW, 240, DOCK_VIEW)):
    view.show()
    for width in widths:
        view.resize(width, 700)
        qtbot.waitUntil(lambda: t.viewport().width() > 0, timeout=2000)
        qtbot.wait(50)
        _columns_whole(t)
        yield width


def test_the_cost_table_fits_the_attention_dock(qtbot):
    """Its headers were cut to "context n", "ecode ste per head", "hole mod" in the 310 px dock."""
    view = CostView()
    qtbot.addWidget(view)
    view.set_model({"n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "context_limit": 8192})
    view.set_context(293)
    t = view.table
    for width in _at_widths(qtbot, view, t):
        if width == DOCK_VIEW:   # the dock's width at 1100 px: all of it in view, no sideways scroll
            assert t.horizontalHeader().length() <= t.viewport().width()
    assert [t.item(r, 0).text() for r in range(t.rowCount())] == ["293\n(now)", "1,000", "10,000", "100,000"]
    assert t.horizontalHeaderItem(0).text() == "tokens" and t.horizontalHeaderItem(4).text() == "decode\nmodel"
    assert t.item(0, 4).text() == "79.1 k"   # 293 x 30 x 9


def test_the_why_sqrt_d_table_fits_the_attention_dock(qtbot):
    """Its rows "128 (you…", "64 (mo…" and header "op weigl unscaled" were cut in the 310 px dock."""
    view = ScaleView()
    qtbot.addWidget(view)
    view.set_head_dim(64)
    t = view.table
    for width in _at_widths(qtbot, view, t):
        if width == DOCK_VIEW:
            assert t.horizontalHeader().length() <= t.viewport().width()
    assert [t.item(r, 0).text() for r in range(t.rowCount())] == ["2", "64", "512", "128\n(yours)", "64\n(model)"]
    assert t.rowHeight(3) > t.rowHeight(0)   # the note on a line of its own


def test_the_formula_tables_tokens_show_whole_and_it_scrolls_sideways(qtbot):
    """The stretched token column was squeezed to "oken", its tokens cut to "<|i…" (or, laid out
    first at another width, kept 325 px and pushed the numbers out of view)."""
    view = NumbersView()
    qtbot.addWidget(view)
    keys = [0, 90, 199]
    view.set_steps({"offset": 0, "scale": 0.125, "query": 292, "query_token": ".", "layer": 18, "head": 6, "kv_head": 2,
                    "head_dim": 64, "query_norm": 14.6, "n_keys": 293, "max_scaled": 4.5, "denominator": 1.27,
                    "output_norm": 1.94, "top_output_norm": 1.84, "keys": keys,
                    "tokens": ["<|im_start|>", "<|im_start|>", "\n\n"], "raw": [36.0, 20.6, 15.3],
                    "scaled": [4.5, 2.57, 1.92], "exp": [1.0, 0.1455, 0.0755], "weights": [0.786, 0.114, 0.059],
                    "value_norms": [1.0, 1.0, 1.0], "contribution_norms": [0.786, 0.114, 0.059]})
    t = view.table
    for _ in _at_widths(qtbot, view, t, widths=(DOCK_VIEW,)):
        assert t.horizontalHeader().length() > t.viewport().width()   # seven columns: it scrolls
        head = t.horizontalHeader()
        assert [head.sectionSize(c) for c in range(t.columnCount())] == [
            max(head.sectionSizeHint(c), t.sizeHintForColumn(c)) for c in range(t.columnCount())]   # none wider
    assert t.horizontalScrollBar().maximum() > 0


def test_the_by_hand_table_fits_the_attention_dock(qtbot):
    """Stretched into 261 px on X, "÷√d_k" (46 px) and "weight" (51 px) got 43 px each."""
    from desktop.panels.attention.sandbox import SandboxView

    view = SandboxView()
    qtbot.addWidget(view)
    view.load_example()
    t = view.table
    for width in _at_widths(qtbot, view, t):
        if width == DOCK_VIEW:
            assert t.horizontalHeader().length() <= t.viewport().width()
    assert t.item(1, 5).text() == "0.768" and t.horizontalHeaderItem(4).text() == "÷√d"
