"""Model files and devices in the app, through the real worker and the real loader:
a model without a chat template is run with a plain format and the window says so; a
device that is not here falls back with a notice; bad files are one line, never a traceback."""
from __future__ import annotations

import pickle

import pytest
from PySide6.QtCore import Qt

import runtime
from desktop.worker import EngineWorker


def real_worker(folder=None):
    """The real worker on the real loader; ``folder`` replaces the window's source when given."""
    return EngineWorker(load_fn=lambda source, device: runtime.load_model(folder or source, device=device))


def send(qtbot, window, text, timeout=30_000):
    window.input.setPlainText(text)
    with qtbot.waitSignal(window.reply_finished, timeout=timeout) as blocker:
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    return blocker.args[0]


def test_a_model_without_a_chat_template_is_run_plainly_and_the_window_says_so(qtbot, make_window,
                                                                              tiny_without_template):
    w = make_window(worker=real_worker(tiny_without_template), load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000) as loaded:
        w.load_model(str(tiny_without_template))
    assert loaded.args[0]["chat_template"] is False
    text = w.notice.text()
    assert w.notice.isVisible() and "no chat template" in text and "plain" in text and "\n" not in text
    assert "no chat template" in w.status.currentMessage()
    w.generation_overrides = {"max_new_tokens": 4}
    result = send(qtbot, w, "the a and")
    assert result["reason"] in ("stop", "length")


def test_a_model_with_a_template_gets_no_notice(qtbot, make_window, tiny_folder):
    """The control for the test above."""
    w = make_window(worker=real_worker(tiny_folder), load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000) as loaded:
        w.load_model(str(tiny_folder))
    assert loaded.args[0]["chat_template"] is True and loaded.args[0]["notices"] == []
    assert not w.notice.isVisible()


@pytest.mark.parametrize("device", ["cuda:7", "mps"])
def test_a_device_that_is_not_here_falls_back_with_a_notice(qtbot, make_window, tiny_folder, device):
    if device in {d for d, _ in runtime.available_devices()}:
        pytest.skip(f"this machine has {device}")
    w = make_window(worker=real_worker(tiny_folder), load=False)
    w.settings.set("model/device", device)   # as a settings file from another machine would hold
    with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000) as loaded:
        w.load_model(str(tiny_folder))
    info = loaded.args[0]
    assert info["device_fallback"] == device and info["device"] != device
    text = w.notice.text()
    assert w.notice.isVisible() and device in text and "not available" in text and "\n" not in text
    assert w.settings.get("model/device") == "auto"   # the setting falls back too
    w.generation_overrides = {"max_new_tokens": 4}
    assert send(qtbot, w, "the a and")["reason"] in ("stop", "length")


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name, content, words", [
    ("model.bin", None, ["pickle", "never unpickles"]),
    ("notes.gguf", b"just some notes\n" * 10, ["not a GGUF file"]),
    ("empty.gguf", b"", ["empty"]),
    ("cut.gguf", b"GGUF\x03\x00\x00\x00", ["could not be read", "truncated"]),
])
def test_bad_model_files_are_one_line_in_the_window(qtbot, make_window, tmp_path, name, content, words):
    marker = tmp_path / "UNPICKLED"
    path = tmp_path / name
    path.write_bytes(pickle.dumps(_Payload(marker)) if content is None else content)
    w = make_window(worker=real_worker(), load=False)
    failures = []
    w.engine.load_failed.connect(failures.append)
    with qtbot.waitSignal(w.engine.load_failed, timeout=30_000):
        w.load_model(str(path))
    assert len(failures) == 1
    text = w.notice.text()
    assert w.notice.isVisible() and text.startswith("Could not load the model") and name in text
    assert "\n" not in text and "Traceback" not in text
    for word in words:
        assert word in text
    assert not marker.exists(), "the checkpoint was unpickled"
    assert not w.engine.model and not w.send_button.isEnabled()
