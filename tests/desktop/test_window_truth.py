"""The window says what is true: findings from real starts, on real widgets."""
from __future__ import annotations

from PySide6.QtCore import QEvent, QObject

from desktop.chat.pages import ASK
from desktop.main_window.replies import CONTEXT_FULL


class PaintCounter(QObject):
    def __init__(self):
        super().__init__()
        self.paints = 0

    def eventFilter(self, obj, event):  # noqa: N802 - Qt API
        if event.type() == QEvent.Type.Paint:
            self.paints += 1
        return False


def test_the_empty_chat_repaints_when_the_model_has_loaded(qtbot, make_window):
    w = make_window(load=False)
    counter = PaintCounter()
    w.chat.viewport().installEventFilter(counter)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("fake.gguf")
        assert w.chat.placeholder == "Loading the model…"
    qtbot.wait(50)
    before = counter.paints
    assert w.chat.placeholder == ASK
    # Setting the text asks for a repaint at once, not at the first message.
    w.chat.placeholder = "Loading the model…"
    qtbot.waitUntil(lambda: counter.paints > before, timeout=2000)
    seen = counter.paints
    w.chat.placeholder = ASK
    qtbot.waitUntil(lambda: counter.paints > seen, timeout=2000)


import pytest  # noqa: E402


@pytest.mark.parametrize("size", [(1100, 720), (1366, 768)])
def test_the_chat_takes_at_least_half_the_width(qtbot, make_window, size):
    w = make_window()
    w.resize(*size)
    qtbot.waitUntil(lambda: w.width() == size[0], timeout=2000)
    qtbot.wait(100)
    docks = [d for d in w.panels.values() if d.isVisible()]
    assert docks, "the panels are shown beside the chat by default"
    chat = w.stack.width()
    print("chat", chat, "sidebar", w.sidebar.width(), "docks", [d.width() for d in docks],
          [d.minimumSizeHint().width() for d in docks], [d.widget().minimumSizeHint().width() for d in docks])
    assert chat >= size[0] / 2
    assert all(d.width() >= 260 for d in docks)   # the panels stay usable beside it
    assert w.sidebar.width() >= 170              # and conversation titles readable


def test_a_full_context_says_so_and_stores_no_orphan_message(qtbot, make_window, tmp_path_factory):
    """Overflow "stop" and a full context: a banner with the two ways on, the message back in
    the box, nothing stored without a reply (a real tiny model on the real worker)."""
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    from desktop.worker import EngineWorker

    tiny = load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 40, "temperature": 0.0, "overflow": "stop", "context": 40}
    with qtbot.waitSignal(w.reply_finished, timeout=30_000):
        w.submit("the cat")   # the reply fills the 40-token context
    conv = w.current_conversation
    stored = [(m.role, m.content) for m in w.store.messages(conv)]
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.submit("and the dog")
    assert done.args[0]["reason"] == "context" and done.args[0]["text"] == ""
    assert [(m.role, m.content) for m in w.store.messages(conv)] == stored   # no orphan "You" message
    assert w.messages.rowCount() == len(stored)
    assert w.notice.isVisible() and "The context is full" in w.notice.text()
    assert w.input.toPlainText() == "and the dog"
    w.notice.linkActivated.emit("overflow")
    assert w.settings.get("generation/overflow") == "truncate-middle" and not w.notice.isVisible()
    w.show_error(CONTEXT_FULL)
    w.notice.linkActivated.emit("new")
    assert w.current_conversation != conv and w.messages.rowCount() == 0
