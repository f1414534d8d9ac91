"""Rolling overflow, seen: the messages the model no longer sees are faded with a note, the
banner says so (and whether the system prompt is kept), and the KV readout names the sinks."""
from __future__ import annotations

from desktop.chat.delegate import STALE_UNSEEN_NOTE, UNSEEN_NOTE
from desktop.worker import EngineWorker
from runtime import Finish, Message, TextPiece, TurnStats
from tests.desktop.fakes import FakeSession, fake_load


class RollingSession(FakeSession):
    """Replies "ok"; its figures say the first messages were evicted (as runtime.ChatSession's
    rolling policy reports them): all but the last three messages, sinks 30 (the system prompt)."""

    system_kept = True

    def _generate(self):
        self.messages.append(Message("assistant", "ok"))
        yield TextPiece("ok")
        n = len(self.messages)
        stats = TurnStats(prompt_tokens=120, completion_tokens=1, context_limit=128, sink_tokens=30 if self.system_kept else 4,
                          system_kept=self.system_kept, unseen_messages=max(0, n - 3),
                          kv_cache={"tokens": 128, "bytes_per_token": 64, "dtype": "float32"})
        yield Finish("stop", "ok", stats)


def notes(w) -> list[str]:
    d = w.chat.itemDelegate()
    return [d.state_text(w.messages.index(r, 0)) for r in range(w.messages.rowCount())]


def send(qtbot, w, text):
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit(text)


def test_evicted_messages_are_faded_with_a_note_and_the_banner_says_so(qtbot, make_window, tmp_path):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: RollingSession(g)))
    w.settings.set("generation/overflow", "rolling")
    send(qtbot, w, "first question")
    assert w.chat.unseen == 0 and not w.page.unseen_banner.isVisible()
    send(qtbot, w, "second question")
    send(qtbot, w, "third question")
    # The three the model no longer sees are faded, each with the note, and the banner says so.
    assert w.chat.unseen == 3 and notes(w)[:3] == [UNSEEN_NOTE] * 3 and UNSEEN_NOTE not in notes(w)[3:]
    banner = w.page.unseen_banner
    assert banner.isVisible() and banner.text().startswith("The model no longer sees the first 3 messages (faded)")
    assert "It keeps the system prompt." in banner.text()
    kv = w.panels["kvCachePanel"].widget()
    kv.redraw()
    assert "after the first 30 (the system prompt, kept as attention sinks)" in kv.readout.text()
    w.grab().save(str(tmp_path / "unseen.png"))
    # Another conversation and back: the fade comes back from the stored figures.
    conv = w.current_conversation
    w.new_conversation()
    assert w.chat.unseen == 0 and not banner.isVisible()
    w.open_conversation(conv)
    assert w.chat.unseen == 3 and banner.isVisible()


def test_a_lost_system_prompt_is_said(qtbot, make_window):
    RollingSession.system_kept = False
    try:
        w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: RollingSession(g)))
        w.settings.set("generation/overflow", "rolling")
        send(qtbot, w, "a very long system prompt")
        text = w.page.unseen_banner.text()
        assert w.page.unseen_banner.isVisible() and w.chat.unseen == 0
        assert text.startswith("It has lost the system prompt after its first 4 tokens")
    finally:
        RollingSession.system_kept = True


def test_one_evicted_message_reads_as_one(qtbot, make_window):
    # One message reads as one ("the first message ... evicted it"), not "the first 1 message ... them".
    w = make_window()
    w.page.show_unseen(1)
    assert w.page.unseen_banner.text().startswith(
        "The model no longer sees the first message (faded): the rolling overflow policy evicted it from its KV cache.")


def test_after_a_restart_the_fade_is_the_last_replys_not_the_models(qtbot, make_window):
    """After a restart with other settings no cache of the conversation exists and the next
    message reads it all again: the messages stay faded (the last reply did not see them), but
    the banner and notes say it was the last reply, not "The model no longer sees"."""
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: RollingSession(g)))
    w.settings.set("generation/overflow", "rolling")
    for text in ("first question", "second question", "third question"):
        send(qtbot, w, text)
    conv = w.current_conversation
    w.settings.set("generation/context", 4096)   # other cache settings: no cache of it now (as after a restart)
    w.new_conversation()
    w.open_conversation(conv)
    banner = w.page.unseen_banner
    assert w.chat.unseen == 3 and banner.isVisible()   # still faded: the last reply did not see them
    assert banner.text().startswith("The last reply did not see the first 3 messages (faded)")
    assert "Your next message reads the conversation again with the current settings." in banner.text()
    assert "no longer sees" not in banner.text() and UNSEEN_NOTE not in notes(w)
    assert notes(w)[:3] == [STALE_UNSEEN_NOTE] * 3


class TruncatingSession(RollingSession):
    """The same figures as truncate-middle reports them: the first messages left out of the prompt."""

    def _generate(self):
        for ev in super()._generate():
            if isinstance(ev, Finish):
                ev.stats.unseen_policy, ev.stats.sink_tokens = "truncate-middle", 0
            yield ev


def test_messages_truncate_middle_left_out_are_faded_and_said(qtbot, make_window, tmp_path):
    """Under truncate-middle (the default overflow) the dropped turns are faded and said, as
    under rolling."""
    from desktop.chat.delegate import DROPPED_NOTE

    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=lambda m, s, g: TruncatingSession(g)))
    for text in ("first question", "second question", "third question"):
        send(qtbot, w, text)
    assert w.chat.unseen == 3 and notes(w)[:3] == [DROPPED_NOTE] * 3 and DROPPED_NOTE not in notes(w)[3:]
    banner = w.page.unseen_banner.text()
    assert banner.startswith("The model no longer sees the first 3 messages (faded): the conversation passed the "
                             "context, and truncate-middle left them out of the prompt")
    assert "evicted" not in banner and UNSEEN_NOTE not in notes(w)
    w.grab().save(str(tmp_path / "truncated.png"))
