"""The window keeps each reply's token ids in the database, and a reopened conversation's
next turn reuses them (real worker thread, a tiny seeded random model)."""
from __future__ import annotations

import pytest

from desktop.worker import EngineWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024),
                      device="cpu", dtype="float32")


def send_and_wait(qtbot, window, text: str):
    with qtbot.waitSignal(window.reply_finished, timeout=30_000) as done:
        window.submit(text)
    return done.args[0]


def test_reply_ids_are_stored_and_reused_after_a_restart(qtbot, make_window, tiny):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 16, "temperature": 0.0}
    first = send_and_wait(qtbot, w, "the cat")
    conv = w.current_conversation
    reply = w.store.messages(conv)[-1]
    assert reply.role == "assistant" and reply.content == first["text"]
    # The random model's ids, all but the bytes of a character its length stop cut.
    assert reply.token_ids is not None and 0 < len(reply.token_ids) <= first["stats"]["completion_tokens"]
    assert reply.token_model == str(tiny.path)
    assert tiny.tokenizer.decode(list(reply.token_ids)) == reply.content
    w.close()

    # A new window on the same database: a fresh session, whose prompt takes the stored ids.
    again = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    again.generation_overrides = {"max_new_tokens": 4, "temperature": 0.0}
    again.open_conversation(conv)
    second = send_and_wait(qtbot, again, "and the dog")
    assert second["stats"]["retokenized_tokens"] == 0
    # The same conversation with the reply re-tokenized from its text would count it.
    with qtbot.waitSignal(again.reply_finished, timeout=30_000) as done:
        again.store.add_message(conv, "assistant", "typed by hand")
        again.submit("and then")
    assert done.args[0]["stats"]["retokenized_tokens"] == len(tiny.tokenizer.encode("typed by hand", add_special_tokens=False))


def test_editing_the_first_of_three_turns_reuses_the_cached_prefix_and_stores_a_whole_conversation(
        qtbot, make_window, tiny):
    from runtime import Message
    from runtime.generate.chat_format import encode_conversation

    tok = tiny.tokenizer
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 16, "temperature": 0.0}
    for text in ("the cat is here", "and the dog", "or a bird"):
        assert send_and_wait(qtbot, w, text)["text"]
    conv = w.current_conversation
    assert [m.role for m in w.store.messages(conv)] == ["user", "assistant"] * 3
    system = w.generation().get("system_prompt") or None
    head = [Message("system", system)] if system else []
    old = encode_conversation(tok, head + [Message("user", "the cat is here")]).ids
    new = encode_conversation(tok, head + [Message("user", "the cat is there")]).ids
    lcp = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)

    w.edit_message(0)
    w.input.setPlainText("the cat is there")
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.input.submit()
    result = done.args[0]
    stats = result["stats"]
    # The cache held three turns; the edit reuses it up to the first changed token only.
    assert (stats["prompt_tokens"], stats["reused_tokens"], stats["prefilled_tokens"]) == (len(new), lcp, len(new) - lcp)
    stored = w.store.messages(conv)
    assert [(m.role, m.content) for m in stored] == [("user", "the cat is there"), ("assistant", result["text"])]
    assert tok.decode(list(stored[1].token_ids)) == stored[1].content
    w.close()

    again = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    again.open_conversation(conv)
    assert again.store.messages(conv) == stored
    assert [again.messages.message(r)["content"] for r in range(again.messages.rowCount())] == [
        "the cat is there", result["text"]]


def test_an_edit_too_long_for_the_context_is_refused_in_one_line_like_a_send(qtbot, make_window, tiny):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: tiny))
    w.generation_overrides = {"max_new_tokens": 8, "temperature": 0.0, "overflow": "stop", "context": 40}
    assert send_and_wait(qtbot, w, "the cat")["reason"] in ("stop", "length")
    conv = w.current_conversation
    before = [(m.id, m.role, m.content) for m in w.store.messages(conv)]
    w.edit_message(0)
    long = " ".join(["the cat and the dog"] * 12)   # over 40 tokens alone
    w.input.setPlainText(long)
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.input.submit()
    assert done.args[0]["kind"] == "edit" and done.args[0]["reason"] == "error" and done.args[0]["text"] == ""
    assert w.notice.isVisible() and "context" in w.notice.text() and "Traceback" not in w.notice.text()
    # As a send that is refused: the conversation is as it was (the reply the edit would have
    # dropped too), and the edit is still open with the text that did not fit.
    assert [(m.id, m.role, m.content) for m in w.store.messages(conv)] == before
    assert w.messages.rowCount() == 2 and w.edit_banner.isVisible() and w.chat.edit_row == 0
    assert w.input.toPlainText() == long
