"""One end-to-end test: the real window, the real worker thread, the real default model."""
from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from desktop.worker import EngineWorker


@pytest.mark.slow
def test_the_default_model_answers_in_the_window(qtbot, make_window, default_model_file):
    w = make_window(worker=EngineWorker(), load=False)
    w.generation_overrides = {"max_new_tokens": 12, "temperature": 0.0}
    with qtbot.waitSignal(w.engine.model_loaded, timeout=240_000) as loaded:
        w.load_model(str(default_model_file))
    assert loaded.args[0]["context_limit"] == 8192 and "SmolLM2" in w.status.model_label.text()
    w.input.setPlainText("What is the capital of France?")
    with qtbot.waitSignal(w.reply_finished, timeout=240_000) as done:
        qtbot.keyClick(w.input, Qt.Key.Key_Return)
    result = done.args[0]
    assert result["reason"] in ("stop", "length") and "paris" in result["text"].lower(), result
    stats = result["stats"]
    assert stats["prompt_tokens"] > 0 and stats["completion_tokens"] > 0 and stats["context_used"] > stats["prompt_tokens"]
    reply = w.store.messages(w.current_conversation)[-1]
    assert reply.role == "assistant" and reply.content == result["text"] and reply.stats["ttft_s"] > 0
    assert w.messages.message(1)["content"] == result["text"]
    assert "TTFT" in w.status.speed_label.text() and "/ 8,192" in w.status.context_label.text()
