"""The attention panel's Formula tab follows what the user does (a tiny seeded random model
on the real worker thread): a query picked on a mean-of-heads snapshot gets its numbers for
one head, a head change recomputes them, and an edit never leaves a gone conversation's
numbers on screen as if current."""
from __future__ import annotations

import pytest
from PySide6.QtCore import QPointF, Qt
from PySide6.QtTest import QTest

from desktop.panels.attention.panel import NUMBERS, PANEL_NAME, SNAPSHOT
from desktop.main_window.window import PANEL_MIN_WIDTH
from desktop.worker import EngineWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def send(qtbot, w, text):
    with qtbot.waitSignal(w.reply_finished, timeout=20_000):
        w.submit(text)


def opened(qtbot, w, tab):
    dock = w.panels[PANEL_NAME]
    dock.toggleViewAction().trigger()
    panel = dock.widget()
    panel.tabs.setCurrentIndex(tab)
    qtbot.waitUntil(panel.isVisible, timeout=2000)
    return panel


def test_a_query_clicked_on_the_mean_of_heads_gets_its_formula_and_a_head_change_recomputes_it(
        qtbot, make_window, tiny, tmp_path):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 6, "temperature": 0.0}
    send(qtbot, w, "the cat sat")
    c = None
    with qtbot.waitSignal(w.panels[PANEL_NAME].widget().client.snapshot_ready, timeout=10_000):
        panel = opened(qtbot, w, SNAPSHOT)
    c = panel.client
    assert panel.selected_head == "mean"
    heat = panel.snapshot.heat
    qtbot.waitUntil(lambda: heat.image() is not None)
    T = len(panel.snapshot.snap["tokens"])
    r = heat.plot_rect()
    row = T - 3
    QTest.mouseClick(heat, Qt.MouseButton.LeftButton,
                     pos=QPointF(r.left() + 0.5 * r.width() / T, r.top() + (row + 0.5) * r.height() / T).toPoint())
    assert panel.numbers.query.value() == row and "head 0" in panel.status.text()
    # The Formula tab computes at once, for its own head (not "choose one head" and empty).
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.tabs.setCurrentIndex(NUMBERS)
    assert (got.args[0]["query"], got.args[0]["head"]) == (row, 0)
    qtbot.waitUntil(lambda: panel.numbers.table.rowCount() == 5)
    assert f"Query #{row}" in panel.numbers.explanation.text() and "head 0" in panel.numbers.explanation.text()
    # Another head in the tab's own box: recomputed without Compute; the panel's mean stays.
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.numbers.head.setValue(2)
    assert got.args[0]["head"] == 2 and panel.selected_head == "mean"
    # One head chosen for the panel: the formula follows it, and its box shows it.
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.select_head(3)
    assert got.args[0]["head"] == 3 and panel.numbers.head.value() == 3
    qtbot.waitUntil(lambda: "head 3" in panel.numbers.explanation.text())
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.numbers.head.setValue(1)   # and the box changes the panel's head
    assert got.args[0]["head"] == 1 and panel.selected_head == 1
    panel.export_png(tmp_path / "formula.png")
    # The Head box did not widen the tab past the dock's narrowest width.
    assert panel.numbers.minimumSizeHint().width() <= PANEL_MIN_WIDTH


def test_after_an_edit_the_formula_of_the_old_conversation_is_marked_then_cleared(qtbot, make_window, tiny):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 12, "temperature": 0.0}
    for text in ("the cat sat on the mat", "and the dog ran off", "then a bird sang"):
        send(qtbot, w, text)
    panel = opened(qtbot, w, NUMBERS)
    c = panel.client
    panel.select_head(1)
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.numbers.query.setValue(60)
    assert got.args[0]["query"] == 60
    qtbot.waitUntil(lambda: panel.numbers.table.rowCount() == 5)
    # Edit the first message: the conversation is now one short turn.
    w.edit_message(0)
    w.input.setPlainText("a")
    with qtbot.waitSignal(w.reply_finished, timeout=20_000):
        w.input.submit()
    # At once: the old numbers are marked out of date (greyed, and said so) ...
    assert not panel.numbers.table.isEnabled() and "Out of date" in panel.numbers.footer.text()
    # ... then, as query 60 is past the new end, cleared with the reason in the tab itself.
    qtbot.waitUntil(lambda: panel.numbers.table.rowCount() == 0, timeout=10_000)
    assert "No numbers: query token 60 is outside" in panel.numbers.explanation.text()
    assert "Query #60" not in panel.numbers.explanation.text() and panel.numbers.footer.text() == ""
    assert panel.numbers.data() == {}   # nothing old to export either
    with qtbot.waitSignal(c.numbers_ready, timeout=10_000) as got:
        panel.numbers.query.setValue(-1)   # the newest token: computed again at once
    qtbot.waitUntil(lambda: panel.numbers.table.rowCount() > 0 and panel.numbers.table.isEnabled())
