"""Server > Serve the loaded model from this process: the window's own model (the worker's object,
no second copy and no child process) answers HTTP requests, also while the chat writes a reply;
unticking the toggle or closing the window stops it; and where it cannot serve from here it says
why (no model, a remote server) or runs the process server and says that.

The window's worker is a real one over the run's loaded default model (tests/conftest.py), so
no test loads a model of its own.
"""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import httpx2 as httpx
import psutil
import pytest

from attnchat.server.in_process import for_window
from desktop.worker import EngineWorker
from runtime import ChatSession, GenerationSettings, Message, SamplingParams
from runtime.generate.events import Finish
from tests.desktop.test_serve_toggle import _fake_command

ASK = "What is the capital of France?"


#: Serving children this test process had before the test began: other test files' shared servers
#: (a session fixture's ``attnchat serve`` in the same pytest worker), not this test's.
_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _servers_before():
    _BEFORE.clear()
    _BEFORE.update(pid for pid, _ in _serving())
    yield


def _serving() -> list[tuple[int, str]]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            args = p.cmdline()
            if p.status() != psutil.STATUS_ZOMBIE and ("serve" in args or "attnchat: serving" in " ".join(args)):
                out.append((p.pid, " ".join(args)))
        except psutil.Error:
            pass
    return out


def _serve_children() -> list[str]:
    """The command lines of this process's live children that serve, started since the test began:
    ``attnchat serve`` (or the stand-in that prints its line), not the chat template's sandbox."""
    return [args for pid, args in _serving() if pid not in _BEFORE]


def _greedy(model, ask: str, tokens: int) -> str:
    """The reply a chat session on ``model`` writes for ``ask`` (greedy), as the window's chat does."""
    s = ChatSession(model, settings=GenerationSettings(context_limit=512, max_new_tokens=tokens,
                                                       sampling=SamplingParams(temperature=0)))
    s.messages = [Message("user", ask)]
    ids = next(e for e in s.reply() if isinstance(e, Finish)).token_ids
    return model.tokenizer.decode(list(ids))


def _ask(url: str, model: str, ask: str, tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": ask}], "max_tokens": tokens, "temperature": 0})


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture
def serving_window(qtbot, make_window, default_model, default_model_file):
    """``start() -> window`` on the loaded default model, serving it from this process."""
    def start(**kwargs):
        worker = EngineWorker(load_fn=lambda source, device: default_model)
        w = make_window(load=False, worker=worker, serve_factory=for_window, **kwargs)
        with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000):
            w.load_model(str(default_model_file))
        w.settings.set("generation/context", 512)   # a small KV pool: a quick start
        return w
    return start


def test_the_toggle_serves_the_windows_own_model_and_stops(qtbot, serving_window, default_model):
    w = serving_window()
    toggle, panel = w.serve_toggle, w.server_panel
    assert toggle.action.isEnabled() and toggle.how_action.text().startswith("From this window's model")
    toggle.action.trigger()
    assert toggle.label.text().startswith("Starting the server")
    qtbot.waitUntil(lambda: toggle.server.state != "starting", timeout=60_000)
    s = toggle.server
    assert s is toggle.local and s.state == "serving", s.error
    assert s._server.engine.model is w.engine.worker.model is default_model   # the chat's weights, not a copy
    port = w.settings.get("server/port")
    assert port > 0 and s.url == f"http://127.0.0.1:{port}/v1"
    assert toggle.label.text().endswith(f"Serving at {s.url}") and toggle.label.isVisible()
    assert "from this window's model" in panel.state.text() and panel.address.text() == s.url
    r = _ask(s.url, s.model_id, ASK, 8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == _greedy(default_model, ASK, 8)
    assert s.pid == psutil.Process().pid and _serve_children() == []   # no second process

    url = s.url
    toggle.action.trigger()                  # off: returns at once, stopped within seconds
    t0 = time.monotonic()
    qtbot.waitUntil(lambda: s.state == "stopped", timeout=10_000)
    assert time.monotonic() - t0 < 6
    assert not toggle.action.isChecked() and not toggle.label.isVisible() and not s.error
    assert _refused(url)
    assert "Not serving" in panel.state.text()


def test_a_request_while_the_chat_writes_its_reply_answers(qtbot, serving_window, default_model):
    w = serving_window()
    w.generation_overrides = {"max_new_tokens": 150, "temperature": 0.0}
    toggle = w.serve_toggle
    toggle.action.trigger()
    qtbot.waitUntil(lambda: toggle.server.state == "serving", timeout=60_000)
    w.submit("Count from one to one hundred, in words.")
    qtbot.waitUntil(lambda: w.replying and bool(w.replies.reply.get("text")), timeout=60_000)   # it is writing
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=_ask(toggle.server.url, toggle.server.model_id, ASK, 8),
                                                   replying=w.replying))
    t.start()
    with qtbot.waitSignal(w.reply_finished, timeout=120_000) as finished:
        pass
    qtbot.waitUntil(lambda: not t.is_alive(), timeout=120_000)
    assert got["r"].status_code == 200, got["r"].text
    assert got["replying"], "the chat's reply ended before the request's: they did not run together"
    assert got["r"].json()["choices"][0]["message"]["content"] == _greedy(default_model, ASK, 8)
    assert finished.args[0]["reason"] in ("stop", "length") and finished.args[0]["text"]
    w.close()                                # closing the window stops the server
    assert toggle.server.state == "stopped" and _refused(f"http://127.0.0.1:{w.settings.get('server/port')}/v1")


def test_with_no_model_or_a_remote_one_it_says_why_it_cannot_serve(qtbot, make_window):
    w = make_window(load=False, serve_factory=for_window)
    toggle = w.serve_toggle
    assert not toggle.action.isEnabled()
    assert toggle.how_action.text() == "No model is loaded: open one (File > Models…) to serve it"
    remote = SimpleNamespace(remote=True, info=lambda: {
        "name": "m", "path": "http://127.0.0.1:9/v1", "device": "server 127.0.0.1:9", "dtype": "", "context_limit": 2048,
        "load_seconds": 0.0, "remote": True, "base_url": "http://127.0.0.1:9/v1", "source": "http://127.0.0.1:9/v1#m"})
    w.engine.worker._load_fn = lambda source, device: remote
    with qtbot.waitSignal(w.engine.model_loaded, timeout=5000):
        w.load_model("http://127.0.0.1:9/v1#m")
    toggle.menu.aboutToShow.emit()
    assert not toggle.action.isEnabled()
    assert toggle.how_action.text().startswith("The window chats with a remote server")
    toggle.action.setChecked(True)           # even if asked: nothing starts, and the status bar says why
    assert not toggle.action.isChecked() and toggle.server.state == "stopped" and not toggle.server.running
    assert w.status.currentMessage().startswith("The window chats with a remote server")


def test_without_the_factory_it_runs_the_process_server_and_says_so(qtbot, make_window):
    w = make_window()                        # a window the attnchat command did not start
    toggle = w.serve_toggle
    assert toggle.local is None and toggle.how_action.text().startswith("Would run a second process")
    toggle.process.command_fn = _fake_command(
        "import time; print('attnchat: serving fake.gguf on cpu at http://127.0.0.1:1/v1 (no API key)', flush=True); "
        "time.sleep(600)")
    toggle.action.trigger()
    qtbot.waitUntil(lambda: toggle.server.state == "serving", timeout=30_000)
    assert toggle.server is toggle.process and len(_serve_children()) == 1   # a child this time
    assert w.notice.text().startswith("Serving from a second process with its own copy of the weights: "
                                      "this window was started without the attnchat command")
    assert "second process" in w.server_panel.state.text() and "its own copy" in toggle.label.toolTip()
    w.close()
    assert toggle.server.state == "stopped"


def test_a_taken_port_says_where_to_choose_another(qtbot, serving_window):
    w = serving_window()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        w.settings.set("server/port", taken.getsockname()[1])
        w.serve_toggle.action.trigger()
        qtbot.waitUntil(lambda: w.serve_toggle.server.state != "starting", timeout=60_000)
    assert w.serve_toggle.server.state == "failed" and not w.serve_toggle.action.isChecked()
    assert w.notice.text().startswith("The server did not start: cannot listen on 127.0.0.1:")
    assert w.notice.text().endswith("choose another port in View > Server panel or stop what uses it")
