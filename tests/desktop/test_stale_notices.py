"""An error goes when what it was about is over: the status bar's copy of the notice line
stayed for its 10 s after a new reply, a load or another conversation had hidden the line
(on screen: "The message needs 1,231 tokens…" under a reply being written)."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from desktop.worker import EngineWorker
from tests.desktop.fakes import fake_load
from tests.desktop.test_daily_driver import _Refusing


@pytest.mark.parametrize("then", ["send", "load", "new chat"])
def test_the_status_bar_drops_the_error_the_notice_dropped(qtbot, make_window, then):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=_Refusing()), delay=0.05)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello")   # a chat with a turn: New chat opens another
    w.input.setPlainText("x" * 5000)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    said = w.notice.text()
    assert w.notice.isVisible() and said.startswith("The message needs") and w.status.currentMessage() == said
    if then == "send":
        w.input.setPlainText("short")
        with qtbot.waitSignal(w.reply_finished, timeout=5000):
            qtbot.keyClick(w.input, Qt.Key.Key_Return)
            assert w.replying and not w.notice.isVisible() and w.status.currentMessage() == ""
    elif then == "load":
        with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
            w.load_model("other.gguf")
            assert not w.notice.isVisible() and said not in w.status.currentMessage()
    else:
        w.new_conversation()
        assert not w.notice.isVisible() and w.status.currentMessage() == ""
    assert said not in w.status.currentMessage()


def test_a_message_of_its_own_in_the_status_bar_stays(qtbot, make_window):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=_Refusing()))
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello")
    w.input.setPlainText("x" * 5000)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    w.status.showMessage("Copied the message", 3000)
    w.new_conversation()
    assert w.status.currentMessage() == "Copied the message"


def _loading_slowly(make_window):
    """A window whose first model is still loading: the window, and the gate that lets the load end."""
    import threading

    gate = threading.Event()

    def slow_load(source, device):
        gate.wait(5)
        return fake_load(source, device)

    w = make_window(load=False, worker=EngineWorker(load_fn=slow_load, session_fn=_Refusing()))
    w.load_model("fake.gguf")
    return w, gate


def test_enter_while_the_model_loads_says_why_nothing_is_sent(qtbot, make_window):
    """It said so only in the status bar ("No model is loaded yet"): at a first start the
    window is up before the model, and Enter seemed to do nothing."""
    from desktop.main_window.replies import LOADING_NOTE

    w, gate = _loading_slowly(make_window)
    w.input.setPlainText("hello")
    qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert w.notice.isVisible() and w.notice.text() == LOADING_NOTE and w.notice.property("kind") == "note"
    assert w.input.toPlainText() == "hello"   # kept, and nothing stored
    assert not w.current_conversation or w.store.messages(w.current_conversation) == []
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        gate.set()
    assert not w.notice.isVisible()   # loaded: the note goes, and Enter sends
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert [m.content for m in w.store.messages(w.current_conversation)][0] == "hello"


def test_the_message_box_has_the_focus_while_the_first_model_loads(qtbot, make_window):
    """The window opened with the focus in "Search chats": what a new user typed while the
    model loaded filtered the chat list away, and Enter sent nothing."""
    w, gate = _loading_slowly(make_window)
    assert w.focusWidget() is w.input
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        gate.set()
    assert w.focusWidget() is w.input


def test_a_draft_survives_a_restart(qtbot, make_window):
    """What was typed and not sent was lost at Quit (drafts were kept only while the app ran)."""
    w = make_window()
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello")
    first = w.current_conversation
    w.input.setPlainText("a question I had not sent")
    w.new_conversation()
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("another chat")
    second = w.current_conversation
    w.input.setPlainText("half a thought\nover two lines")
    w.close()
    again = make_window()
    assert again.current_conversation == second and again.input.toPlainText() == "half a thought\nover two lines"
    again.open_conversation(first)
    assert again.input.toPlainText() == "a question I had not sent"
    again.input.clear()   # sent or cleared: not kept
    again.edit_message(0)   # the box holds the message being edited: not a draft
    assert again.input.toPlainText() == "hello"
    again.close()
    third = make_window()
    third.open_conversation(first)
    assert third.input.toPlainText() == ""
