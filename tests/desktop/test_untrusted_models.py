"""Untrusted models in the window: a model whose chat template would take gigabytes answers with a
banner (one line) and the window goes on; a GGUF whose metadata would take gigabytes is
refused at load with a banner. The real worker thread and runtime.load_model.
"""
from __future__ import annotations

import pytest

from desktop.worker import EngineWorker
from models.safety import template as sandbox
from tests.models import gguf_files
from tests.runtime.tiny_models import CHAT_TEMPLATE

BOMB = "{{ 'x' * 4000000000 }}"


@pytest.fixture(scope="module")
def bomb_model(tmp_path_factory):
    from runtime import load_model
    from tests.runtime.tiny_models import make_tiny_model

    m = load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_positions=1024),
                   device="cpu", dtype="float32")
    m.tokenizer.chat_template = BOMB + CHAT_TEMPLATE
    return m


def test_a_template_bomb_is_a_banner_and_the_window_goes_on(qtbot, make_window, bomb_model):
    w = make_window(worker=EngineWorker(load_fn=lambda source, device: bomb_model))
    w.generation_overrides = {"max_new_tokens": 4, "temperature": 0.0}
    with qtbot.waitSignal(w.reply_finished, timeout=60_000) as done:
        w.submit("hi")
    assert done.args[0]["reason"] == "error"
    text = w.notice.text()
    assert w.notice.isVisible() and text.startswith("The model's chat template needed over 256 MiB"), text
    assert "\n" not in text and "Traceback" not in text
    if sandbox.memory_limited():
        assert sandbox.last_render().peak_rss_bytes < 384 << 20
    assert not w.replying and w.send_button.isEnabled()


def test_a_metadata_bomb_is_refused_at_load_with_a_banner(qtbot, make_window, tmp_path):
    path = gguf_files.metadata_bomb_files(tmp_path)["4x2^20-empty-strings"]
    w = make_window(worker=EngineWorker(), load=False)
    with qtbot.waitSignal(w.engine.load_failed, timeout=120_000):
        w.load_model(str(path))
    text = w.notice.text()
    assert w.notice.isVisible() and text.startswith("Could not load the model: strings.gguf was refused: its header "
                                                    "could not be read within attnchat's limits"), text
