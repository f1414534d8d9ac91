"""Faults in the app mid-reply: Stop during prefill, rapid Send/Stop, a model switch while a
reply streams, disk full when saving, out of memory in the runtime, a 100 KB paste, and
unusual text saved to and read back from SQLite."""
from __future__ import annotations

import errno
import random
import sqlite3
import time

import pytest
from PySide6.QtCore import QMimeData, Qt

import runtime
import runtime.model.decoder
from desktop.chat import store as store_mod
from desktop.chat.store import Store
from desktop.main_window.window import sentence
from desktop.worker import EngineWorker
from runtime import Finish, Message, PrefillProgress, TextPiece, TurnStats
from tests.desktop.fakes import REPLY, FakeSession, fake_load, fake_session_factory

FULL_REPLY = "".join(REPLY)


def send(qtbot, window, text, timeout=5000):
    window.input.setPlainText(text)
    with qtbot.waitSignal(window.reply_finished, timeout=timeout) as blocker:
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    return blocker.args[0]


def assert_consistent(window, conv: int) -> list[tuple[str, str]]:
    """The view shows exactly what the database holds: user turns, each with at most one reply."""
    stored = [(m.role, m.content) for m in window.store.messages(conv)]
    rows = [window.messages.message(i) for i in range(window.messages.rowCount())]
    assert [(r["role"], r["content"]) for r in rows] == stored
    assert not any(r["streaming"] for r in rows)
    assert stored and stored[0][0] == "user"
    assert all(not (a[0] == b[0] == "assistant") for a, b in zip(stored, stored[1:]))
    assert window.store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    return stored


# ---- Stop ----------------------------------------------------------------------------------
class StepSession(FakeSession):
    """A fake session whose prefill takes ``prefill_steps`` steps; cancel is honoured in both phases."""

    def __init__(self, settings, prefill_steps=40, script=None, delay=0.02):
        super().__init__(settings, script, delay)
        self.prefill_steps = prefill_steps
        self.cancelled_in: str | None = None

    def _generate(self):
        self._cancel.clear()
        total, shown, reason = 10 * self.prefill_steps, [], "stop"
        yield PrefillProgress(0, total)
        for step in range(1, self.prefill_steps + 1):
            if self._cancel.is_set():
                self.cancelled_in = "prefill"
                yield Finish("cancelled", "", TurnStats(prompt_tokens=total, prefilled_tokens=10 * (step - 1)))
                return
            time.sleep(self.delay)
            yield PrefillProgress(10 * step, total)
        for piece in self.script:
            if self._cancel.is_set():
                self.cancelled_in, reason = "decode", "cancelled"
                break
            time.sleep(self.delay)
            shown.append(piece)
            yield TextPiece(piece)
        text = "".join(shown)
        if text:
            self.messages.append(Message("assistant", text))
        yield Finish(reason, text, TurnStats(prompt_tokens=total, completion_tokens=len(shown)))


def test_stop_during_prefill(qtbot, make_window):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: StepSession(g)))
    w.input.setPlainText("a long prompt")
    with qtbot.waitSignal(w.engine.prefill_progress, timeout=5000):
        w.input.submit()
    assert w.replying
    t0 = time.perf_counter()
    with qtbot.waitSignal(w.reply_finished, timeout=5000) as done:
        qtbot.mouseClick(w.stop_button, Qt.MouseButton.LeftButton)
    assert time.perf_counter() - t0 < 1.0
    assert done.args[0]["reason"] == "cancelled" and done.args[0]["text"] == ""
    assert FakeSession.instances[-1].cancelled_in == "prefill"
    conv = w.current_conversation
    assert assert_consistent(w, conv) == [("user", "a long prompt")]   # no empty reply
    assert not w.status.prefill.isVisible() and w.send_button.isVisible() and not w.stop_button.isVisible()
    # The next message is answered in full.
    FakeSession.instances[-1].prefill_steps = 2
    result = send(qtbot, w, "again")
    assert result["reason"] == "stop" and result["text"] == FULL_REPLY


def test_twenty_rapid_send_stop_clicks_then_a_full_exchange(qtbot, make_window):
    w = make_window(script=["tok "] * 30, delay=0.005)
    finished = []
    w.engine.finished.connect(finished.append)
    rnd = random.Random(8)
    for i in range(20):
        if i % 2 == 0:
            if not w.input.toPlainText():
                w.input.setPlainText(f"message {i}")
            w.send_button.click()
        else:
            w.stop_button.click()
        qtbot.wait(rnd.choice([0, 0, 1, 3, 8]))   # sometimes the worker has started, sometimes not
    qtbot.waitUntil(lambda: not w.replying and not w.engine.busy, timeout=5000)
    result = send(qtbot, w, "the last one")
    assert result["reason"] == "stop" and result["text"] == "tok " * 30
    conv = w.current_conversation
    stored = assert_consistent(w, conv)
    assert stored[-2:] == [("user", "the last one"), ("assistant", "tok " * 30)]
    users = [c for r, c in stored if r == "user"]
    assert len(users) == len(finished) and len(users) >= 2   # every request finished exactly once
    assert len({r["request"] for r in finished}) == len(finished)
    assert {m.finish_reason for m in w.store.messages(conv) if m.role == "assistant"} <= {"cancelled", "stop"}
    assert w.send_button.isVisible() and w.send_button.isEnabled() and not w.stop_button.isVisible()


def test_switching_the_model_while_a_reply_streams(qtbot, make_window):
    script = {"pieces": ["tok "] * 500}
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: FakeSession(
        g, script["pieces"], 0.02)))
    w.input.setPlainText("a long answer please")
    with qtbot.waitSignal(w.engine.text_batch, timeout=5000):
        w.input.submit()
    script["pieces"] = ["short"]
    results = []
    w.reply_finished.connect(results.append)
    t0 = time.perf_counter()
    with qtbot.waitSignals([w.reply_finished, w.engine.model_loaded], timeout=5000):
        w.load_model("other-model.gguf")
    assert time.perf_counter() - t0 < 2.0, "the reply was not stopped for the new model"
    [result] = results
    assert result["reason"] == "cancelled" and result["text"].startswith("tok ")
    conv = w.current_conversation
    assert assert_consistent(w, conv)[-1] == ("assistant", result["text"])
    assert w.settings.get("model/source") == "other-model.gguf"
    assert send(qtbot, w, "and now?")["text"] == "short"


# ---- disk full -----------------------------------------------------------------------------
DISK_FULL = [sqlite3.OperationalError("database or disk is full"), OSError(errno.ENOSPC, "No space left on device")]


def _fail_writes(monkeypatch, error):
    """Every store write fails as a full disk would (reads still work)."""
    def enter(self):
        raise error
    monkeypatch.setattr(store_mod._Transaction, "__enter__", enter)


@pytest.mark.parametrize("error", DISK_FULL, ids=["sqlite", "enospc"])
def test_disk_full_when_saving_a_message_keeps_it_in_the_box(qtbot, make_window, monkeypatch, error):
    w = make_window(script=["ok"])
    send(qtbot, w, "first")
    conv = w.current_conversation
    _fail_writes(monkeypatch, error)
    w.input.setPlainText("second message")
    with qtbot.assertNotEmitted(w.engine.finished, wait=50):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert not w.replying
    text = w.notice.text()
    assert w.notice.isVisible() and "Could not save your message" in text and "\n" not in text
    assert str(error.strerror if isinstance(error, OSError) and error.strerror else error) in text
    assert w.input.toPlainText() == "second message"          # nothing typed is lost
    assert assert_consistent(w, conv) == [("user", "first"), ("assistant", "ok")]
    monkeypatch.undo()   # space is freed: sending again saves it
    result = send(qtbot, w, w.input.toPlainText())
    assert result["reason"] == "stop"
    assert assert_consistent(w, conv) == [("user", "first"), ("assistant", "ok"),
                                          ("user", "second message"), ("assistant", "ok")]


@pytest.mark.parametrize("error", DISK_FULL, ids=["sqlite", "enospc"])
def test_disk_full_when_saving_a_reply_keeps_it_and_the_next_save_retries(qtbot, make_window, monkeypatch, error):
    w = make_window(script=["a ", "b ", "c"], delay=0.05)
    w.input.setPlainText("question one")
    with qtbot.waitSignal(w.engine.text_batch, timeout=5000):
        w.input.submit()   # the question is saved; the disk fills up while the reply streams
    _fail_writes(monkeypatch, error)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        pass
    conv = w.current_conversation
    text = w.notice.text()
    assert w.notice.isVisible() and "Could not save the reply" in text and "\n" not in text
    shown = [(w.messages.message(i)["role"], w.messages.message(i)["content"]) for i in range(w.messages.rowCount())]
    assert shown == [("user", "question one"), ("assistant", "a b c")]   # kept on screen
    assert not w.messages.message(1)["streaming"]
    assert [m.content for m in w.store.messages(conv)] == ["question one"]
    w.open_conversation(conv)   # re-reading the conversation keeps it too
    assert w.messages.rowCount() == 2 and w.messages.message(1)["content"] == "a b c"
    # Still full: the next message is refused, nothing is lost.
    w.input.setPlainText("question two")
    qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert not w.replying and w.input.toPlainText() == "question two" and w.messages.rowCount() == 2
    monkeypatch.undo()
    result = send(qtbot, w, "question two")
    assert result["reason"] == "stop"
    assert assert_consistent(w, conv) == [("user", "question one"), ("assistant", "a b c"),
                                          ("user", "question two"), ("assistant", "a b c")]
    # The history the worker got had the saved reply in it.
    assert [m.content for m in FakeSession.instances[-1].messages] == ["question one", "a b c", "question two", "a b c"]


# ---- out of memory -------------------------------------------------------------------------
def _oom(*args, **kwargs):
    import torch

    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                 "of 8.00 GiB\nof which 1.00 GiB is free.")


@pytest.mark.parametrize("where", ["cache", "forward"])
def test_out_of_memory_is_one_clear_line_and_the_app_runs_on(qtbot, make_window, tiny_folder, monkeypatch, where):
    import torch

    w = make_window(worker=EngineWorker(load_fn=lambda s, d: runtime.load_model(tiny_folder, device="cpu")))
    w.generation_overrides = {"max_new_tokens": 6}
    if where == "cache":   # allocating the KV cache
        monkeypatch.setattr(torch, "empty", _oom)
    else:                  # anywhere in a decoder step (activations)
        monkeypatch.setattr(runtime.model.decoder.Decoder, "forward", _oom)
    errors = []
    w.engine.error.connect(errors.append)
    result = send(qtbot, w, "the a and", timeout=30_000)
    monkeypatch.undo()
    assert result["reason"] == "error" and len(errors) == 1, errors
    msg = errors[0]
    assert "out of memory" in msg and "context length" in msg and "\n" not in msg and "Traceback" not in msg
    assert w.notice.isVisible() and w.notice.text() == sentence(msg)   # a capital first letter in the window
    assert w.messages.rowCount() == 1 and not w.replying   # the message stays; no empty reply
    result = send(qtbot, w, "the a and", timeout=30_000)   # and the app runs on
    assert result["reason"] in ("stop", "length") and result["stats"]["completion_tokens"] > 0


def test_an_unexpected_error_in_the_worker_is_one_line(qtbot, make_window):
    w = make_window(fail=RuntimeError("boom: the first line\nand a second line the user never sees"))
    errors = []
    w.engine.error.connect(errors.append)
    result = send(qtbot, w, "hello")
    assert result["reason"] == "error"
    assert errors == ["the reply failed (RuntimeError: boom: the first line); see the log for details"]
    assert w.notice.text() == sentence(errors[0]) == "T" + errors[0][1:]
    assert not w.replying and w.send_button.isEnabled()


# ---- text ----------------------------------------------------------------------------------
PASTE = ("All work and no play makes Jack a dull boy. 東京 👩‍👩‍👧 " * 2400)[:99_999] + "!"


def test_a_100_kb_paste_is_refused_in_one_notice_and_not_lost(qtbot, make_window, tiny_folder):
    w = make_window(worker=EngineWorker(load_fn=lambda s, d: runtime.load_model(tiny_folder, device="cpu")))
    # greedy: a sampled reply (the default now) may stop at its first token, and an empty
    # reply stores no assistant message
    w.generation_overrides = {"max_new_tokens": 4, "temperature": 0.0}
    errors = []
    w.engine.error.connect(errors.append)
    mime = QMimeData()
    mime.setText(PASTE)
    w.input.insertFromMimeData(mime)
    assert w.input.toPlainText() == PASTE and len(PASTE.encode()) > 100_000
    with qtbot.waitSignal(w.reply_finished, timeout=60_000) as done:
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert done.args[0]["reason"] == "error"
    assert len(errors) == 1
    msg = errors[0]
    assert "the message needs" in msg and "context holds 128" in msg and "shorten the message" in msg
    assert w.notice.isVisible() and w.notice.text() == sentence(msg) and "\n" not in msg
    conv = w.current_conversation
    # The conversation is left as it was (nothing stored) and the paste is back in the box, intact.
    assert [(m.role, m.content) for m in w.store.messages(conv)] == []
    assert w.messages.rowCount() == 0 and w.input.toPlainText() == PASTE
    # The conversation goes on with a message that fits.
    result = send(qtbot, w, "the a and", timeout=60_000)
    assert result["reason"] in ("stop", "length")
    assert [m.role for m in w.store.messages(w.current_conversation)] == ["user", "assistant"]


UNUSUAL = [
    "NUL\x00inside, BEL\x07, ESC\x1b[31m, DEL\x7f and \x01\x02 control characters",
    "👩‍👩‍👧 🇫🇷🇯🇵 東京 مرحبا שלום e\u0301 a\u0308 zero\u200bwidth join\u200d",
]


def test_unusual_text_and_a_100_kb_paste_are_saved_and_read_back_intact(qtbot, make_window, tmp_path):
    w = make_window(script=["ok \x00 ", "🇫🇷"])
    for text in UNUSUAL + [PASTE]:
        mime = QMimeData()
        mime.setText(text)
        w.input.clear()
        w.input.insertFromMimeData(mime)
        with qtbot.waitSignal(w.reply_finished, timeout=5000):
            qtbot.keyClick(w.input, Qt.Key.Key_Return)
    conv = w.current_conversation
    expected = [x for text in UNUSUAL + [PASTE] for x in (("user", text), ("assistant", "ok \x00 🇫🇷"))]
    w.close()
    w.store.close()
    store = Store(tmp_path / "chat.sqlite3")
    assert [(m.role, m.content) for m in store.messages(conv)] == expected
    store.close()
    w2 = make_window(load=False)   # a restart shows them as they were
    assert w2.current_conversation == conv
    assert [(w2.messages.message(i)["role"], w2.messages.message(i)["content"])
            for i in range(w2.messages.rowCount())] == expected
