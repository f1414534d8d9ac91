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
    conv = w._conv_id
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
