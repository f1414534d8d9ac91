"""The status bar never makes the window wider: its fields give way (elided, the whole text in
reach) when they do not fit beside each other.

If the fields' full widths were the window's minimum width, Server > Serve the loaded model,
adding "● Serving at http://127.0.0.1:46717/v1" beside the last reply's figures, would grow the
window from 1,100 to 1,211 px (on a 1,100 px screen its right edge, with the Attention panel,
off the screen).
"""
from __future__ import annotations

from PySide6.QtWidgets import QLabel

from tests.desktop.test_serve_toggle import _fake_command

URL = "http://127.0.0.1:46717/v1"
#: The figures a restart shows for a conversation's last reply (as on the real display).
STALE = {"stale": True, "ttft_s": 1.28, "decode_tokens_per_s": 8.5, "decode_threads": 1, "max_threads": 2,
         "context_used": 113, "context_limit": 856}


def _serve(qtbot, w):
    w.serve_toggle.server.command_fn = _fake_command(
        f"import time; print('attnchat: serving fake.gguf on cpu at {URL} (no API key)', flush=True); "
        "time.sleep(600)")
    w.serve_toggle.action.trigger()
    qtbot.waitUntil(lambda: w.serve_toggle.server.state == "serving", timeout=30_000)


def test_serving_does_not_widen_the_window(qtbot, make_window, tmp_path):
    w = make_window(load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    w.status.model_label.setText("SmolLM2-135M-Instruct.Q4_1")
    w.status.device_label.setText("cpu · Q4_1")
    w.status.set_stats(STALE)
    w.resize(1100, 720)
    qtbot.waitUntil(lambda: w.width() == 1100, timeout=2000)
    try:
        _serve(qtbot, w)
        assert w.serve_toggle.label.text().endswith(f"Serving at {URL}")
        qtbot.wait(200)   # a layout that asks for more width grows the window on its next pass
        w.status.grab().save(str(tmp_path / "statusbar-serving-1100.png"))
        assert w.width() == 1100
        assert w.minimumSizeHint().width() <= 1100 and w.status.minimumSizeHint().width() <= 1100
        shown = [f for f in w.status.fields() if f.isVisible()]
        assert all(f.geometry().right() <= w.status.width() for f in shown)   # none drawn past the bar
        label = w.serve_toggle.label
        assert label.width() >= label.sizeHint().width()   # the address whole
        for f in shown:   # each field shows its text whole, or its start with "…" and the whole in its tooltip
            if isinstance(f, QLabel) and f.width() < f.sizeHint().width():
                assert f.text() in f.toolTip()
        # Narrower still (a 1,024 px screen with the window not maximized): the fields give way.
        w.resize(900, 720)
        qtbot.waitUntil(lambda: w.width() == 900, timeout=2000)
        qtbot.wait(100)
        assert w.width() == 900 and label.width() >= label.sizeHint().width()
        cut = [f for f in w.status.fields() if f.isVisible() and f is not label and f.width() < f.sizeHint().width()]
        assert cut and all(f.text() in f.toolTip() for f in cut)
        w.status.grab().save(str(tmp_path / "statusbar-serving-900.png"))
        # A wide window shows every field whole again.
        w.resize(1366, 720)
        qtbot.waitUntil(lambda: w.width() == 1366, timeout=2000)
        qtbot.wait(100)
        assert all(f.width() >= f.sizeHint().width() for f in w.status.fields() if f.isVisible())
    finally:
        w.serve_toggle.action.trigger()   # stops the fake server
        qtbot.waitUntil(lambda: w.serve_toggle.server.state == "stopped", timeout=10_000)
