"""The window keeps the size it was given: nothing it shows makes it wider (real widgets)."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from tests.desktop.test_chat_actions import click, send


def settle(qtbot, w) -> None:
    """Until the panels' width bound (desktop.main_window.panel_width) no longer moves the chat."""
    last = None
    for _ in range(40):
        w.panel_width.apply()
        qtbot.wait(50)
        if w.stack.width() == last:
            return
        last = w.stack.width()


@pytest.mark.parametrize("which", ["last", "earlier"])
def test_editing_a_message_does_not_widen_the_window(qtbot, make_window, which):
    w = make_window(script=["Paris."])
    send(qtbot, w, "What is the capital of France? Answer with a short list of three facts.")
    send(qtbot, w, "And of Italy?")
    # The attention panel wide, the chat narrow (about 400 px: the panels leave the chat half
    # the window, so a narrow chat needs a narrow window).
    w.resize(880, 720)
    qtbot.waitUntil(lambda: w.width() == 880, timeout=2000)
    w.resizeDocks([w.panels["attentionPanel"]], [560], Qt.Orientation.Horizontal)
    settle(qtbot, w)   # the panel's bound applied
    qtbot.waitUntil(lambda: w.stack.width() < 450, timeout=2000)
    chat_width, page_min = w.stack.width(), w.page.minimumSizeHint().width()
    click(qtbot, w, 0 if which == "earlier" else 2, "edit")
    assert w.edit_banner.isVisible() and w.edit_banner.text().startswith("Editing")
    qtbot.wait(100)   # a layout that asks for more width grows the window on its next pass
    assert (w.width(), w.stack.width()) == (880, chat_width)
    assert w.page.minimumSizeHint().width() == page_min   # the banner wraps: it asks for no width
    banner = w.edit_banner
    assert banner.height() >= banner.heightForWidth(banner.width())   # all its lines are shown


def test_a_too_long_count_under_the_box_does_not_widen_the_window(qtbot, make_window):
    w = make_window()
    w.resize(1100, 720)
    qtbot.waitUntil(lambda: w.width() == 1100, timeout=2000)
    settle(qtbot, w)
    chat_width = w.stack.width()
    label = w.page.token_count
    with qtbot.waitSignal(w.engine.counted, timeout=5000):
        w.input.setPlainText(" ".join(["word"] * 2000))   # the fake session: a token a character
    want = "2,000 tokens · prompt 9,999 of 8,192 · too long for the context"
    qtbot.waitUntil(lambda: label.text() == want, timeout=2000)
    qtbot.wait(100)   # a layout that asks for more width grows the window on its next pass
    assert (w.width(), w.stack.width()) == (1100, chat_width)
    assert label.minimumSizeHint().width() <= 120 < label.sizeHint().width()
    w.resize(1000, 720)   # and it lets the window get narrower: the count gives way, whole in its tooltip
    qtbot.waitUntil(lambda: w.width() == 1000, timeout=2000)
    assert label.width() < label.sizeHint().width() and want in label.toolTip()
