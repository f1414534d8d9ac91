"""What a new user tripped on in daily use: a failed load, the wheel over a setting, a
refused message, single newlines in replies (the window on a scripted fake engine)."""
from __future__ import annotations

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication

from desktop.worker import EngineWorker
from runtime import ContextOverflowError
from tests.desktop.fakes import fake_load, fake_session_factory


def _failing_load(source: str, device: str):
    if "broken" in source:
        raise ValueError(f"{source} is not a GGUF file (its first bytes are not GGUF)")
    if "huge" in source:
        raise MemoryError("not enough memory")
    return fake_load(source, device)


def test_a_failed_load_keeps_the_model_that_was_working(qtbot, make_window):
    w = make_window(worker=EngineWorker(load_fn=_failing_load, session_fn=fake_session_factory()))
    assert w.engine.model["name"] == "fake-model"
    with qtbot.waitSignal(w.engine.load_failed, timeout=5000):
        w.load_model("/models/broken.gguf")
    assert w.engine.model and w.engine.model["name"] == "fake-model"
    assert w.send_button.isEnabled()
    assert "fake-model" in w.status.model_label.text()
    assert "broken.gguf is not a GGUF file" in w.notice.text() and "Still using fake-model" in w.notice.text()
    assert w.settings.get("model/source") == "fake.gguf"
    # and it still answers: the worker kept the model
    w.input.setPlainText("still there?")
    with qtbot.waitSignal(w.reply_finished, timeout=5000) as got:
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert got.args[0]["reason"] == "stop" and got.args[0]["text"]


def test_a_load_out_of_memory_lets_the_old_model_go_and_tries_once_more(qtbot, make_window):
    w = make_window(worker=EngineWorker(load_fn=_failing_load, session_fn=fake_session_factory()))
    with qtbot.waitSignal(w.engine.load_failed, timeout=5000):
        w.load_model("/models/huge.gguf")
    assert w.engine.model is None and not w.send_button.isEnabled()
    assert "not enough memory" in w.notice.text()


def _wheel(widget, dy=-120):
    """One wheel notch over ``widget``'s middle (negative: towards the user, scrolling down)."""
    pos = QPointF(widget.width() / 2, widget.height() / 2)
    ev = QWheelEvent(pos, QPointF(widget.mapToGlobal(pos.toPoint())), QPoint(0, 0), QPoint(0, dy),
                     Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, ev)


def test_the_wheel_scrolls_settings_and_never_changes_a_setting_under_the_pointer(qtbot, tmp_path):
    from desktop.settings.dialog import SettingsDialog
    from desktop.settings.values import Settings

    model = {"name": "m", "context_limit": 8192, "n_layers": 30, "n_kv_heads": 3, "head_dim": 64,
             "n_params": 134_515_008, "dtype": "float32", "device": "cpu", "weights_bytes": 100 << 20}
    d = SettingsDialog(Settings(tmp_path / "s.ini"), model, devices=[("auto", "auto"), ("cpu", "CPU")])
    qtbot.addWidget(d)
    d.resize(640, 500)
    d.show()
    qtbot.waitExposed(d)
    source, ctx = d.planner.source, d.fields["generation/context"].editor
    policy = d.fields["generation/cache_policy"].editor
    area = d.tabs.widget(0)
    bar = area.verticalScrollBar()
    assert bar.maximum() > 0   # the tab scrolls at this height
    before = (source.currentIndex(), ctx.value(), policy.currentIndex())
    for w in (source, ctx, ctx.findChild(type(ctx.lineEdit())), policy):
        at = bar.value()
        _wheel(w)
        assert bar.value() > at or bar.value() == bar.maximum()   # the page scrolled instead
    assert (source.currentIndex(), ctx.value(), policy.currentIndex()) == before
    # A field the user clicked into takes the wheel, as in a browser's form.
    ctx.setFocus()
    qtbot.waitUntil(ctx.hasFocus, timeout=2000)
    _wheel(ctx, dy=120)
    assert ctx.value() == before[1] + ctx.singleStep()
