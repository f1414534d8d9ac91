"""Server > Serve the loaded model: a real ``attnchat serve`` child process, started and stopped.

The window's own engine is the fake one (only its model's path matters here); the
server loads the real default model in its own process, as it does in the app.
"""
from __future__ import annotations

import sys

import httpx2 as httpx
import psutil
import pytest

from desktop.remote.serve_toggle import ModelServer, serve_command

#: Loading the model in a fresh process on a busy two-core machine can take a while.
START_TIMEOUT_MS = 180_000


def _servers() -> list[psutil.Process]:
    """This process's children that are still alive (zombies are reaped, not left)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _fake_command(script: str):
    """A command_fn that runs ``python -c script`` instead of ``attnchat serve``."""
    return lambda model_path, device, **options: (sys.executable, ["-c", script])


def test_the_command_serves_on_a_free_loopback_port():
    program, args = serve_command("/m/x.gguf", "cpu")
    assert program == sys.executable and args[:2] == ["-I", "-B"] and args[args.index("attnchat") + 1] == "serve"
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == "0"
    assert args[args.index("--model") + 1] == "/m/x.gguf" and args[args.index("--device") + 1] == "cpu"
    # Nothing that widens what the server answers (see the guard assertions below).
    assert not {"--allowed-host", "--cors-origin", "--api-key"} & set(args)


@pytest.mark.slow
def test_the_toggle_serves_the_loaded_model_and_stops_it(qtbot, make_window, default_model_file):
    w = make_window(load=False)
    toggle = w.serve_toggle
    assert not toggle.action.isEnabled()    # nothing to serve yet
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model(str(default_model_file))
    assert toggle.action.isEnabled() and not toggle.label.isVisible()

    toggle.action.trigger()
    assert toggle.action.isChecked() and toggle.label.text().startswith("Starting the server")
    qtbot.waitUntil(lambda: toggle.server.state != "starting", timeout=START_TIMEOUT_MS)
    server = toggle.server
    assert server.state == "serving", server.error
    assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
    assert toggle.label.text().endswith(f"Serving at {server.url}") and toggle.label.isVisible()
    assert toggle.copy_action.isEnabled()
    models = httpx.get(server.url + "/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [server.model_id] and server.model_id.startswith("SmolLM2-135M-Instruct")
    # The child inherits every guard of `attnchat serve` (tests/server/test_guard.py).
    assert httpx.get(server.url + "/models", headers={"Host": "evil.example"}, timeout=30).status_code == 403
    assert httpx.get(server.url + "/models", headers={"Origin": "http://evil.example"}, timeout=30).status_code == 403
    assert httpx.post(server.url + "/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"},
                      timeout=30).status_code == 415
    pid, url = server.pid, server.url
    assert pid in [p.pid for p in _servers()]

    toggle.action.trigger()                 # off: returns at once, the process ends soon after
    qtbot.waitUntil(lambda: server.state == "stopped", timeout=15_000)
    assert not toggle.action.isChecked() and not toggle.label.isVisible() and not server.error
    assert pid not in [p.pid for p in _servers()]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5)


def test_closing_the_window_stops_the_server(qtbot, make_window):
    w = make_window(load=False)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("/models/fake.gguf")
    w.serve_toggle.server.command_fn = _fake_command(
        "import time; print('attnchat: serving fake.gguf on cpu at http://127.0.0.1:1/v1 (no API key)', flush=True); "
        "time.sleep(600)")
    w.serve_toggle.action.trigger()
    qtbot.waitUntil(lambda: w.serve_toggle.server.state == "serving", timeout=30_000)
    pid = w.serve_toggle.server.pid
    assert w.serve_toggle.label.text().endswith("Serving at http://127.0.0.1:1/v1")
    w.close()
    assert w.serve_toggle.server.state == "stopped" and pid not in [p.pid for p in _servers()]


def test_a_server_that_cannot_start_says_why(qtbot, make_window):
    w = make_window()
    w.serve_toggle.server.command_fn = _fake_command(
        "import sys; print('attnchat: error: cannot listen on 127.0.0.1:0 (no reason); pick another --port', "
        "file=sys.stderr); sys.exit(2)")
    w.serve_toggle.action.trigger()
    qtbot.waitUntil(lambda: w.serve_toggle.server.state == "failed", timeout=30_000)
    # The command line's advice in the window's words: the port is the panel's choice.
    assert w.notice.text() == ("The server did not start: cannot listen on 127.0.0.1:0 (no reason); "
                               "choose another port in View > Server panel")
    assert not w.serve_toggle.action.isChecked() and not w.serve_toggle.label.isVisible()


def test_stop_kills_a_server_that_ignores_it(qtbot, monkeypatch):
    monkeypatch.setattr("desktop.remote.process_server.STOP_GRACE_MS", 300)
    server = ModelServer(command_fn=_fake_command(
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "print('attnchat: serving m on cpu at http://127.0.0.1:1/v1', flush=True); time.sleep(600)"))
    server.start("/m/x.gguf")
    qtbot.waitUntil(lambda: server.state == "serving", timeout=30_000)
    pid = server.pid
    server.stop()
    qtbot.waitUntil(lambda: server.state == "stopped", timeout=10_000)
    assert pid not in [p.pid for p in _servers()]
