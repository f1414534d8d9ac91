"""One-click actions on the messages (real widgets, clicks on the painted buttons): copy a
message or a code block, edit any of your messages and resend, and the reply being written
with its state and its own Stop button."""
from __future__ import annotations

import sqlite3

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette

from desktop.chat.messages import MessageListModel
from desktop.chat.store import Store
from tests.desktop.fakes import FakeSession


def send(qtbot, window, text, timeout=5000):
    with qtbot.waitSignal(window.reply_finished, timeout=timeout) as blocker:
        window.submit(text)
    return blocker.args[0]


def button(window, row: int, name: str, arg: int = -1):
    found = [b for b in window.chat.buttons(row) if b.name == name and b.arg == arg]
    return found[0] if found else None


def click(qtbot, window, row: int, name: str, arg: int = -1) -> None:
    b = button(window, row, name, arg)
    assert b is not None, f"message {row} has no {name} button: {[x.name for x in window.chat.buttons(row)]}"
    qtbot.mouseClick(window.chat.viewport(), Qt.MouseButton.LeftButton, pos=b.rect.center())


def three_turns(qtbot, w):
    for q in ["First question", "Second question", "Third question"]:
        send(qtbot, w, q)
    return w.current_conversation


# ---- copy --------------------------------------------------------------------------------------
def test_copy_a_message_and_a_code_block_with_one_click(qtbot, make_window):
    reply = "Build it:\n```make\nall:\n\tcc x.c\n```\nThen run:\n```bash\n./a.out\n```\n"
    w = make_window(script=[reply])
    send(qtbot, w, "How do I **build** it?")
    QGuiApplication.clipboard().clear()
    click(qtbot, w, 0, "copy")
    assert QGuiApplication.clipboard().text() == "How do I **build** it?"   # the text as written
    assert w.chat.flash == (0, "copy", -1)   # the button says "Copied ✓" for a moment
    click(qtbot, w, 1, "copy")
    assert QGuiApplication.clipboard().text() == reply
    # Each code block has its own button; the copy keeps the Makefile's tab.
    assert [b.arg for b in w.chat.buttons(1) if b.name == "code"] == [0, 1]
    click(qtbot, w, 1, "code", 0)
    assert QGuiApplication.clipboard().text() == "all:\n\tcc x.c"
    click(qtbot, w, 1, "code", 1)
    assert QGuiApplication.clipboard().text() == "./a.out"
    assert w.chat.flash == (1, "code", 1) and "Copied the code block" in w.status.currentMessage()
    qtbot.waitUntil(lambda: w.chat.flash is None, timeout=3000)


# ---- the reply being written -------------------------------------------------------------------
def _fill_share(image, rect, colour: QColor) -> float:
    """The share of ``rect``'s pixels within 40 of ``colour`` on each channel."""
    hits = total = 0
    for x in range(rect.left() + 4, rect.right() - 3, 3):
        for y in range(rect.top() + 4, rect.bottom() - 3, 2):
            c = image.pixelColor(x, y)
            total += 1
            hits += all(abs(a - b) < 40 for a, b in ((c.red(), colour.red()), (c.green(), colour.green()),
                                                      (c.blue(), colour.blue())))
    return hits / max(1, total)


def test_the_reply_being_written_shows_its_state_and_its_stop_button(qtbot, make_window):
    w = make_window(script=["tok "] * 300, delay=0.03)
    with qtbot.waitSignal(w.engine.text_batch, timeout=5000):
        w.submit("Go on")
    row = 1
    index = w.messages.index(row)
    delegate = w.chat.delegate()
    assert index.data(MessageListModel.StreamingRole)
    assert delegate.state_text(index) == "Writing…"
    assert [b.name for b in w.chat.buttons(row)] == ["stop"]       # no Copy or Regenerate yet
    assert [b.name for b in w.chat.buttons(0)] == ["copy"]         # and no Edit while it writes
    # Visible: the Stop button is a filled button in the accent colour.
    stop = button(w, row, "stop")
    accent = w.chat.palette().color(QPalette.ColorRole.Highlight)
    assert _fill_share(w.chat.viewport().grab().toImage(), stop.rect, accent) > 0.5

    with qtbot.waitSignal(w.reply_finished, timeout=5000) as done:
        click(qtbot, w, row, "stop")
    assert done.args[0]["reason"] == "cancelled"
    assert not index.data(MessageListModel.StreamingRole)
    assert delegate.state_text(index).startswith("stopped · ")
    assert [b.name for b in w.chat.buttons(row)] == ["copy", "regenerate"]
    assert [b.name for b in w.chat.buttons(0)] == ["copy", "edit"]
    assert _fill_share(w.chat.viewport().grab().toImage(), stop.rect, accent) < 0.2
    assert w.store.messages(w.current_conversation)[-1].finish_reason == "cancelled"


def test_the_prompt_being_read_shows_its_progress(qtbot, make_window):
    w = make_window(script=["late"], delay=0.8)   # the first piece comes 0.8 s after the prompt is read
    w.submit("Read me")
    index = w.messages.index(1)
    qtbot.waitUntil(lambda: index.data(MessageListModel.ProgressRole) is not None, timeout=3000)
    assert w.chat.delegate().state_text(index) == "Reading the prompt… 100%"
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        pass
    assert index.data(MessageListModel.ProgressRole) is None


# ---- edit any message ----------------------------------------------------------------------------
LONG = "Answer" + "\n\nand more" * 12


def test_edit_an_earlier_message_drops_what_came_after_and_says_so(qtbot, make_window, tmp_path):
    w = make_window(script=[LONG])
    conv = three_turns(qtbot, w)
    stored = w.store.messages(conv)
    assert len(stored) == 6

    w.chat.scrollToBottom()
    qtbot.waitUntil(lambda: w.chat.visualRect(w.messages.index(0)).bottom() < 0)   # out of sight
    w.edit_message(0)   # as the button does (tested on message 2 below)
    assert w.input.toPlainText() == "First question"
    assert w.chat.edit_row == 0
    assert w.chat.visualRect(w.messages.index(0)).top() >= 0   # scrolled to the message being edited
    assert w.edit_banner.isVisible() and "drops the 5 messages after it" in w.edit_banner.text()
    # Esc cancels: nothing changed.
    w.input.setFocus()
    qtbot.keyClick(w.input, Qt.Key.Key_Escape)
    assert not w.edit_banner.isVisible() and w.chat.edit_row == -1 and w.input.toPlainText() == ""
    assert w.store.messages(conv) == stored

    click(qtbot, w, 2, "edit")
    assert w.input.toPlainText() == "Second question" and "drops the 3 messages" in w.edit_banner.text()
    FakeSession.instances[-1].script = ["New answer"]
    w.input.setPlainText("Second question, edited")
    with qtbot.waitSignal(w.reply_finished, timeout=5000) as done:
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert done.args[0]["kind"] == "edit" and done.args[0]["text"] == "New answer"
    want = [("user", "First question"), ("assistant", LONG), ("user", "Second question, edited"),
            ("assistant", "New answer")]
    assert [(m.role, m.content) for m in w.store.messages(conv)] == want
    # The worker got the history before the edited message, then the edit.
    assert [(m.role, m.content) for m in FakeSession.instances[-1].messages] == want
    assert [w.messages.message(r)["content"] for r in range(w.messages.rowCount())] == [c for _, c in want]
    assert not w.edit_banner.isVisible() and w.chat.edit_row == -1
    w.close()

    again = make_window()   # a new window on the same database
    again.open_conversation(conv)
    assert [(m.role, m.content) for m in again.store.messages(conv)] == want
    assert again.messages.rowCount() == 4


def test_editing_the_last_message_says_its_reply_is_replaced(qtbot, make_window):
    w = make_window(script=["Answer"])
    three_turns(qtbot, w)
    w.edit_button.click()   # Edit last (Ctrl+E)
    assert w.chat.edit_row == 4
    assert w.edit_banner.text() == "Editing your last message: Enter sends it again and replaces its reply, Esc cancels."
    # Regenerate waits for the edit to be sent or cancelled.
    w.regenerate()
    assert w.messages.rowCount() == 6 and "cancel the edit" in w.status.currentMessage()


def test_an_edit_is_one_transaction(tmp_path):
    store = Store(tmp_path / "chat.sqlite3")
    conv = store.create_conversation().id
    ids = [store.add_message(conv, role, text).id for role, text in
           [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")]]
    before = store.messages(conv)

    def broken_insert(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    store._insert = broken_insert
    with pytest.raises(sqlite3.OperationalError):
        store.edit_message(conv, ids[0], "a, edited")
    assert store.messages(conv) == before   # nothing dropped when the new message could not be written
    del store._insert
    with pytest.raises(ValueError, match="only your own messages"):
        store.edit_message(conv, ids[1], "x")
    with pytest.raises(KeyError):
        store.edit_message(conv, 999, "x")
    assert store.messages(conv) == before
    new = store.edit_message(conv, ids[2], "c, edited")
    assert [(m.role, m.content) for m in store.messages(conv)] == [("user", "a"), ("assistant", "b"), ("user", "c, edited")]
    assert new.id > ids[-1]
    store.close()


def test_editing_the_first_message_retitles_a_chat_titled_after_it(qtbot, make_window):
    w = make_window(script=["Paris."])
    send(qtbot, w, "What is the capital of France? Answer with a short list of three facts.")
    conv = w.current_conversation
    assert w.conversations.title(conv) == "What is the capital of France? Answer with a sho…"
    send(qtbot, w, "And of Spain?")
    click(qtbot, w, 2, "edit")   # not the first message: the title stays
    w.input.setPlainText("And of Portugal?")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.input.submit()
    assert w.conversations.title(conv).startswith("What is the capital of France?")
    click(qtbot, w, 0, "edit")
    w.input.setPlainText("What is the capital of Italy?")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.input.submit()
    assert w.conversations.title(conv) == "What is the capital of Italy?"
    assert w.windowTitle() == "What is the capital of Italy? — attnchat"
    # A title the user chose stays.
    w.store.rename(conv, "Capitals")
    w.conversations.refresh(conv)
    click(qtbot, w, 0, "edit")
    w.input.setPlainText("What is the capital of Peru?")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.input.submit()
    assert w.conversations.title(conv) == "Capitals"


def test_open_model_starts_in_the_models_folder(qtbot, make_window, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    folder = tmp_path / "my-models"
    monkeypatch.setenv("ATTNCHAT_MODELS_DIR", str(folder))
    asked = []
    monkeypatch.setattr(QFileDialog, "getOpenFileName", staticmethod(lambda *a, **k: asked.append(a) or ("", "")))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(lambda *a, **k: asked.append(a) or ""))
    w = make_window()
    opens = {a.text(): a for a in w.file_menu.actions()}
    opens["&Open model…"].trigger()
    opens["Open model &folder…"].trigger()
    assert [a[2] for a in asked] == [str(folder), str(folder)] and folder.is_dir()


def test_each_screenshot_is_announced_as_it_is_written(qtbot, tmp_path, capsys):
    from PySide6.QtWidgets import QLabel

    from desktop.screenshots import _save

    label = QLabel("hello")
    qtbot.addWidget(label)
    written = []
    _save(label, tmp_path / "a.png", written)
    assert capsys.readouterr().out == f"{tmp_path / 'a.png'}\n" and written == [tmp_path / "a.png"]
    _save(label, tmp_path / "missing" / "b.png", written)   # a folder that is not there: said, not listed
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"attnchat: could not write {tmp_path / 'missing' / 'b.png'}\n"
    assert written == [tmp_path / "a.png"]
