"""The Server panel: a port chosen free once and kept, the address to copy, an API key to show
or copy (given to the server in its environment), and the request log from the server's stats."""
from __future__ import annotations

import sys

from PySide6.QtWidgets import QApplication, QLineEdit

from desktop.remote.secrets import KeyStore
from desktop.remote.server_panel import log_rows

SCRIPT = ("import os, sys, time; port = sys.argv[1]; "
          "print(f'attnchat: serving fake.gguf on cpu at http://127.0.0.1:{port}/v1 "
          "key={os.environ.get(\"ATTNCHAT_API_KEY\", \"none\")}', flush=True); time.sleep(600)")


def _recording(calls):
    def command(model_path, device, **options):
        calls.append(options)
        return sys.executable, ["-c", SCRIPT, str(options.get("port", 0))]
    return command


def test_the_port_is_chosen_once_and_kept_and_the_key_goes_in_the_environment(qtbot, make_window):
    w = make_window()
    toggle, panel = w.serve_toggle, w.server_panel
    calls = []
    toggle.server.command_fn = _recording(calls)
    toggle.keys = KeyStore(backend=None)   # memory only: never the machine's keyring
    assert w.settings.get("server/port") == 0 and panel.address.text() == ""
    panel.require_key.setChecked(True)
    key = panel.key.text()
    assert key.startswith("sk-attnchat-") and panel.key.echoMode() == QLineEdit.EchoMode.Password
    panel.show_key.click()
    assert panel.key.echoMode() == QLineEdit.EchoMode.Normal and panel.show_key.text() == "Hide"
    toggle.action.trigger()
    qtbot.waitUntil(lambda: toggle.server.state == "serving", timeout=30_000)
    port = w.settings.get("server/port")
    assert 0 < port == calls[0]["port"] and toggle.server.url == f"http://127.0.0.1:{port}/v1"
    assert toggle.server._lines[-1].endswith(f"key={key}")   # the child got it, not in its arguments
    assert panel.address.text() == toggle.server.url and "with the API key below" in panel.state.text()
    panel.copy_address.click()
    assert QApplication.clipboard().text() == toggle.server.url
    toggle.action.trigger()   # stop
    qtbot.waitUntil(lambda: toggle.server.state == "stopped", timeout=10_000)
    assert panel.address.text() == f"http://127.0.0.1:{port}/v1"   # where it will be again
    toggle.action.trigger()   # the same port the next time
    qtbot.waitUntil(lambda: toggle.server.state == "serving", timeout=30_000)
    assert calls[1]["port"] == port and toggle.api_key() == key   # the same key
    w.close()


def test_the_request_log(qtbot, make_window):
    stats = {"last": [
        {"time": 1_700_000_100.0, "client": "127.0.0.1", "prompt_tokens": 31, "completion_tokens": 1200,
         "decode_tokens_per_s": 9.41, "finish_reason": "stop"},
        {"time": 1_700_000_000.0, "prompt_tokens": 5, "completion_tokens": 0, "decode_tokens_per_s": 0,
         "finish_reason": "cancelled"},
    ]}
    rows = log_rows(stats)
    assert [r[1:] for r in rows] == [("127.0.0.1", "31 → 1,200", "9.4 tok/s", "stop"), ("—", "5 → 0", "—", "cancelled")]
    w = make_window()
    panel = w.server_panel
    panel.show_stats(stats)
    assert panel.table.rowCount() == 2 and panel.table.item(0, 2).text() == "31 → 1,200"
    assert w.findChild(type(panel.dock), "serverDock") is panel.dock and not panel.dock.isVisible()
    panel.dock.show()   # a tab beside the KV panel, not a strip split below it
    assert w.tabifiedDockWidgets(panel.dock)


def test_the_address_shows_whole_in_the_panel_at_1100_px(qtbot, make_window):
    """Beside its label and Copy the field showed "0.0.1:58869/v1" in the 240 px panel."""
    w = make_window()
    w.resize(1100, 720)
    panel = w.server_panel
    panel.dock.show()
    w.settings.set("server/port", 58869)
    qtbot.waitUntil(lambda: panel.address.text() == "http://127.0.0.1:58869/v1", timeout=2000)
    qtbot.waitUntil(lambda: panel.isVisible() and panel.address.width() > 0, timeout=2000)
    qtbot.wait(50)
    a = panel.address
    room = a.width() - a.textMargins().left() - a.textMargins().right() - 8   # the frame and its padding
    assert a.fontMetrics().horizontalAdvance(a.text()) <= room, (a.width(), panel.width())
    assert a.cursorPosition() == 0
