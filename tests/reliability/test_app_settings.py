"""Bad settings in the app: a settings file edited by hand (or from another machine or model)
falls back to valid values with a notice and never stops the app; the dialog refuses bad input;
an empty or whitespace-only message is not sent."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from PySide6.QtCore import QSettings, Qt

import runtime
from desktop.main_window.window import sentence
from desktop.settings.values import DEFAULTS
from desktop.settings.dialog import SettingsDialog
from desktop.worker import EngineWorker
from tests.desktop.fakes import REPLY, FakeSession, fake_load, fake_session_factory

#: What a hand-edited settings file may hold, and what each key must fall back to.
BAD = {
    "generation/context": -5,
    "generation/cache_dtype": "int3",
    "generation/overflow": "sideways",
    "generation/temperature": "nan",
    "generation/top_p": 7.5,
    "generation/top_k": -1,
    "generation/max_new_tokens": 0,
    "generation/sink_tokens": -3,
    "generation/seed": -99,
    "generation/min_p": "abc",
    "generation/repetition_penalty": 0,
    "generation/cache_limit_mib": "inf",
    "model/device": "quantum",
    "model/weight_dtype": "int3",
    "model/attention_backend": "warp-drive",
}


def write_settings(path, values: dict) -> None:
    qs = QSettings(str(path), QSettings.Format.IniFormat)
    for k, v in values.items():
        qs.setValue(k, v)
    qs.sync()


def send(qtbot, window, text, timeout=5000):
    window.input.setPlainText(text)
    with qtbot.waitSignal(window.reply_finished, timeout=timeout) as blocker:
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    return blocker.args[0]


def test_a_hand_edited_settings_file_falls_back_with_a_notice(qtbot, make_window, tmp_path):
    write_settings(tmp_path / "settings.ini", {**BAD, "generation/system_prompt": "Be brief."})  # one good value
    w = make_window()   # builds the window (settings checked), loads the fake model
    qtbot.waitUntil(w.notice.isVisible, timeout=2000)
    text = w.notice.text()
    assert "reset to their defaults" in text and "\n" not in text
    for key, bad in BAD.items():
        assert w.settings.get(key) == DEFAULTS[key], key
        assert key.split("/", 1)[1].replace("_", " ") in text, key
    assert "-5" in text and "quantum" in text
    assert w.settings.get("generation/system_prompt") == "Be brief."   # a good value is kept
    # Nothing invalid reaches the worker: a message is answered.
    result = send(qtbot, w, "hello")
    assert result["reason"] == "stop" and result["text"] == "".join(REPLY)
    assert FakeSession.instances[-1].settings.context_limit is None
    # The dialog opens on valid values.
    d = w.settings_controller.open()
    assert not d.errors and d.ok_button.isEnabled()
    d.close()
    # The file no longer holds them: the next start says nothing.
    w.close()
    assert all(w.settings.stored(key) is None for key in BAD)
    w2 = make_window()
    qtbot.wait(20)
    assert not w2.notice.isVisible()


def test_the_settings_notice_outlives_the_model_load_and_its_own_notices(qtbot, make_window, tmp_path, tiny_folder):
    """Starting a load clears the window's notices and a device fallback brings its own: the
    settings reset must still be said once the model is there."""
    if "cuda:7" in {d for d, _ in runtime.available_devices()}:
        pytest.skip("this machine has cuda:7")
    write_settings(tmp_path / "settings.ini", {"generation/context": -5, "model/device": "cuda:7"})
    w = make_window(worker=EngineWorker(load_fn=lambda s, d: runtime.load_model(tiny_folder, device=d)), load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000):
        w.load_model("tiny")
    qtbot.wait(20)
    text = w.notice.text()
    assert w.notice.isVisible() and "\n" not in text
    assert "cuda:7 is not available" in text and "context -5" in text and text.count("reset to their defaults") == 1
    assert w.settings.get("model/device") == "auto" and w.settings.get("generation/context") == 0


def test_good_settings_give_no_notice(qtbot, make_window, tmp_path):
    """The control for the test above."""
    write_settings(tmp_path / "settings.ini", {"generation/context": 4096, "model/device": "cpu",
                                               "generation/cache_dtype": "bfloat16"})
    w = make_window()
    qtbot.wait(20)
    assert not w.notice.isVisible()
    assert w.settings.get("generation/context") == 4096 and w.settings.get("model/device") == "cpu"


def small_load(source, device):
    """A fake model with a 2,048-token context, 2 layers x 2 KV heads x 8 dims (256 bytes a token in float32)."""
    m = fake_load(source, device)
    m.config = SimpleNamespace(max_position_embeddings=2048, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    return m


@pytest.mark.parametrize("key, value, words", [
    ("generation/context", 100_000, ["context", "100000", "at most 2,048"]),
    ("generation/cache_limit_mib", 0.0001, ["cache limit mib", "holds only 0 tokens"]),
])
def test_settings_that_do_not_fit_the_loaded_model_fall_back(qtbot, make_window, tmp_path, key, value, words):
    write_settings(tmp_path / "settings.ini", {key: value})
    w = make_window(worker=EngineWorker(load_fn=small_load, session_fn=fake_session_factory()))
    text = w.notice.text()
    assert w.notice.isVisible() and "\n" not in text
    for word in words:
        assert word in text
    assert w.settings.get(key) == DEFAULTS[key]
    assert send(qtbot, w, "hello")["reason"] == "stop"


def test_a_cache_limit_below_one_token_through_the_real_session_is_one_line(qtbot, make_window, tiny_folder):
    """Past the settings' checks (set for the next message only): the runtime's CacheLimitError, in one line."""
    w = make_window(worker=EngineWorker(load_fn=lambda s, d: runtime.load_model(tiny_folder, device="cpu")))
    w.generation_overrides = {"cache_limit_mib": 0.0001, "max_new_tokens": 4}   # 104 bytes; a token takes 512
    errors = []
    w.engine.error.connect(errors.append)
    result = send(qtbot, w, "the a and", timeout=30_000)
    assert result["reason"] == "error" and len(errors) == 1
    assert "smaller than one token" in errors[0] and "raise the limit" in errors[0]
    assert w.notice.text().startswith(sentence(errors[0])) and "\n" not in w.notice.text()
    w.generation_overrides = {"max_new_tokens": 4}
    assert send(qtbot, w, "the a and", timeout=30_000)["reason"] in ("stop", "length")


@pytest.mark.parametrize("key, bad, reason", [
    ("generation/context", 10, "at least 64 tokens"),
    ("generation/context", 9000, "at most 8,192 tokens"),
    ("generation/cache_limit_mib", 0.01, "holds only 40 tokens"),
])
def test_the_dialog_refuses_bad_values_and_stores_nothing(make_window, key, bad, reason):
    w = make_window()   # the fake model: 8,192 tokens, 256 bytes a token
    d = SettingsDialog(w.settings, w.engine.model, devices=[("auto", "auto"), ("cpu", "CPU")], parent=w)
    editor = d.fields[key].editor
    editor.setValue(bad)
    assert reason in d.errors[key] and not d.ok_button.isEnabled()
    assert not d.apply() and w.settings.get(key) == DEFAULTS[key]
    d.close()


def test_empty_and_whitespace_messages_are_not_sent(qtbot, make_window):
    w = make_window()
    with qtbot.assertNotEmitted(w.engine.finished, wait=50):
        for text in ("", "   ", "\n\t \n", "\u3000\u2003"):
            w.input.setPlainText(text)
            qtbot.mouseClick(w.send_button, Qt.MouseButton.LeftButton)
            qtbot.keyClick(w.input, Qt.Key.Key_Return)
            w.submit(text)   # the window's own guard, past the input box
    assert w.messages.rowCount() == 0 and all(not w.store.messages(c.id) for c in w.store.conversations())
    assert not w.replying
