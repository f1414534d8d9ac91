"""The Insight tab's "By hand" view shows its table's rows in a short window: at a 740 px
high window its table was squeezed to two rows of the example's three (the texts above it
took the height), with nothing to scroll to the third."""
from __future__ import annotations

import os

import pytest

from tests.desktop.test_panel_width import open_attention, sized

SHOTS = os.environ.get("ATTNCHAT_SHOTS")


def _rows_in_view(t) -> int:
    """Rows of ``t`` whose whole height lies inside its viewport."""
    return sum(1 for r in range(t.rowCount())
               if t.rowViewportPosition(r) >= 0 and t.rowViewportPosition(r) + t.rowHeight(r) <= t.viewport().height())


@pytest.mark.parametrize("size", [(1100, 720), (1366, 768), (1100, 740)])
def test_the_by_hand_table_shows_its_rows(qtbot, make_window, size):
    w = make_window()
    sized(qtbot, w, *size)
    panel = open_attention(qtbot, w).widget()
    panel.tabs.setCurrentWidget(panel.insight.tabs)
    tabs = panel.insight.tabs
    tabs.setCurrentWidget(tabs.sandbox)
    view = tabs.sandbox
    qtbot.waitUntil(view.isVisible, timeout=2000)
    qtbot.wait(80)
    t = view.table
    assert t.rowCount() == 3
    assert _rows_in_view(t) == 3, (size, t.viewport().height(), [t.rowHeight(r) for r in range(3)])
    # nothing below the table out of view where the window has room for it
    if size[1] >= 768:
        assert view.scroll.verticalScrollBar().maximum() == 0, view.scroll.verticalScrollBar().maximum()
    # its columns whole beside the view's scroll bar (the dock's default width at 1,100 px)
    assert t.horizontalHeader().length() <= t.viewport().width(), (t.horizontalHeader().length(), t.viewport().width())
    if SHOTS:
        w.grab().save(os.path.join(SHOTS, f"by-hand-{size[0]}x{size[1]}-example.png"))
    # more keys than the table keeps in view: it scrolls inside, and still shows several rows whole
    view.k.setText("0,1  2,0  1,1  1,0  0,2  3,1  1,3  2,2  0,0  1,2")
    view.v.setText("1,0  0,1  1,1  0,0  2,0  0,2  1,2  2,1  1,0  0,1")
    qtbot.wait(80)
    assert t.rowCount() == 10 and _rows_in_view(t) >= 4, (size, t.viewport().height())
    # and what is below the table (the output and the verdict) can be reached
    area = view.scroll
    body = area.widget()
    assert body.height() >= body.minimumSizeHint().height()
    area.ensureWidgetVisible(view.verdict)
    qtbot.wait(30)
    top = view.verdict.mapTo(area.viewport(), view.verdict.rect().topLeft()).y()
    assert 0 <= top < area.viewport().height()
    if SHOTS:
        w.grab().save(os.path.join(SHOTS, f"by-hand-{size[0]}x{size[1]}.png"))
