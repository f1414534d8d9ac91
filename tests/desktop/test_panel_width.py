"""Panels never take the chat below half the window: their content wraps, the divider moves,
the width is remembered within bounds, and nothing in them is cut off (real widgets)."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTabBar

SHOTS = None   # set to a folder to keep the grabs


def sized(qtbot, w, width, height):
    w.resize(width, height)
    qtbot.waitUntil(lambda: w.width() == width, timeout=2000)
    qtbot.wait(50)


def open_attention(qtbot, w):
    dock = w.panels["attentionPanel"]
    if dock.isHidden():
        dock.toggleViewAction().trigger()   # View > Attention, as a user opens it
    else:   # open, maybe behind another panel's tab: click its tab
        for bar in w.findChildren(QTabBar):
            for i in range(bar.count()):
                if bar.tabText(i) == dock.windowTitle() and bar.parent() is w:
                    bar.setCurrentIndex(i)
    qtbot.waitUntil(dock.isVisible, timeout=2000)
    qtbot.wait(50)
    return dock


@pytest.mark.parametrize("size", [(1100, 720), (1366, 768)])
def test_the_attention_panel_leaves_the_chat_half_the_window_on_every_tab(qtbot, make_window, size, tmp_path):
    w = make_window()
    sized(qtbot, w, *size)
    dock = open_attention(qtbot, w)
    panel = dock.widget()
    half = size[0] // 2
    tabs = [(panel.tabs, i) for i in range(panel.tabs.count())]
    tabs += [(panel.insight.tabs, i) for i in range(panel.insight.tabs.count())]
    for bar, i in tabs:
        if bar is panel.insight.tabs:
            panel.tabs.setCurrentWidget(panel.insight.tabs)
        bar.setCurrentIndex(i)
        qtbot.wait(30)
        assert w.stack.width() >= half, (bar.tabText(i), w.stack.width(), dock.width())
    # Dragging the divider: the panel narrows (it was held at 540 px), and widens only to the bound.
    w.resizeDocks([dock], [240], Qt.Orientation.Horizontal)
    qtbot.wait(50)
    assert dock.width() <= 250 and w.stack.width() > half
    w.resizeDocks([dock], [900], Qt.Orientation.Horizontal)
    qtbot.wait(50)
    assert half <= w.stack.width() <= half + 12 and dock.width() > 300   # as wide as the chat can spare
    dock.grab().save(str(tmp_path / "attention.png"))
    w.grab().save(str(tmp_path / "window.png"))


def test_the_panel_width_is_remembered_within_bounds(qtbot, make_window):
    w = make_window()
    sized(qtbot, w, 1366, 768)
    dock = open_attention(qtbot, w)
    w.resizeDocks([dock], [380], Qt.Orientation.Horizontal)
    qtbot.waitUntil(lambda: abs(dock.width() - 380) <= 2, timeout=2000)
    w.close()

    again = make_window()   # the same settings file: the window state comes back
    sized(qtbot, again, 1366, 768)
    dock = open_attention(qtbot, again)
    assert abs(dock.width() - 380) <= 4
    # The same state in a smaller window: clamped so that the chat keeps half of it.
    sized(qtbot, again, 1100, 720)
    qtbot.waitUntil(lambda: again.stack.width() >= 550, timeout=2000)
    assert dock.width() >= 240


@pytest.mark.parametrize("width", [200, 240, 280, 320, 420])
def test_the_kv_legend_and_chart_are_never_cut_off(qtbot, make_window, width, tmp_path):
    w = make_window()
    sized(qtbot, w, 1100, 720)
    dock = w.panels["kvCachePanel"]
    w.resizeDocks([dock], [width], Qt.Orientation.Horizontal)
    qtbot.wait(80)
    kv = dock.widget()
    item = kv.plot.getPlotItem()
    # The chart's layout (axes, plot, legend under it) fits the widget that shows it.
    assert item.minimumWidth() <= kv.plot.width() + 0.5, (dock.width(), item.minimumWidth(), kv.plot.width())
    assert kv.legend.columnCount == (2 if width >= 320 else 1)
    dock.grab().save(str(tmp_path / f"kv-{width}.png"))


def test_the_head_choice_is_not_cut_when_the_panel_showed_before_the_model(qtbot, make_window, tmp_path):
    # The attention panel, open (behind the KV panel's tab) while the model loads: the head box
    # widens to its items, not as wide as its empty self ("Mean of hea").
    w = make_window(load=False)
    sized(qtbot, w, 1100, 720)
    panel = open_attention(qtbot, w).widget()
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("fake.gguf")
    qtbot.waitUntil(lambda: panel.head.count() > 2, timeout=2000)
    qtbot.wait(50)
    text = panel.head.fontMetrics().horizontalAdvance("Mean of heads")
    panel.grab().save(str(tmp_path / "attention-after-load.png"))
    assert panel.head.width() >= panel.head.sizeHint().width() and panel.head.sizeHint().width() > text + 16


def test_three_panels_tabbed_at_1100_px_show_their_titles_whole(qtbot, make_window):
    """KV cache, Attention and Server tabbed on the right of an 1100 x 720 window: the tabs read
    "KV-cache me…", "Atten…" and "Se…"."""
    w = make_window()
    sized(qtbot, w, 1100, 720)
    open_attention(qtbot, w)
    server = w.findChild(type(w.panels["attentionPanel"]), "serverDock")
    server.toggleViewAction().trigger()
    qtbot.waitUntil(server.isVisible, timeout=2000)
    qtbot.wait(50)
    titles = {w.panels["kvCachePanel"].windowTitle(), w.panels["attentionPanel"].windowTitle(), server.windowTitle()}
    assert titles == {"KV cache", "Attention", "Server"}
    bars = [b for b in w.findChildren(QTabBar)
            if b.parent() is w and {b.tabText(i) for i in range(b.count())} == titles]
    assert len(bars) == 1, [[b.tabText(i) for i in range(b.count())] for b in w.findChildren(QTabBar)]
    bar = bars[0]
    for i in range(bar.count()):   # an elided tab is drawn narrower than its text needs
        assert bar.tabRect(i).width() >= bar.tabSizeHint(i).width(), (bar.tabText(i), bar.tabRect(i).width())
    assert bar.tabRect(bar.count() - 1).right() <= bar.width()   # all in view, no scroll arrows needed
