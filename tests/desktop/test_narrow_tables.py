"""Tables in narrow panels show their headers and cells whole: the Knock out tab's induction
test at the attention dock's width (about 240 px in an 1100 x 720 window)."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from desktop.panels.attention.insight.views import KnockoutView  # noqa: E402

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
