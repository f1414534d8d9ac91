"""The remote engine end to end: the window's worker chatting through a real ``attnchat serve``.

The session's shared server (``server`` in tests/conftest.py: the real default model on
the CPU, an API key; tests/server uses the same process) answers every test that needs
one. Key storage uses keyring's real API with an in-memory backend, so no test touches
the user's own keyring.
"""
from __future__ import annotations

import socket
import threading
import time

import httpx2 as httpx
import pytest
from jaraco.classes import properties
from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError, PasswordSetError

from desktop.remote.client import (
    RemoteModel,
    is_remote_source,
    normalize_base_url,
    parse_remote_source,
    remote_source,
    source_label,
)
from desktop.remote.engine import RemoteEngineWorker, usage_text
from desktop.remote.secrets import SERVICE, KeyStore
from tests.live_server import API_KEY

FRANCE = "What is the capital of France?"
LONG_ASK = "Count from 1 to 1000, separated by commas."


class MemoryKeyring(KeyringBackend):
    """A keyring backend in a dict (never picked by keyring on its own: it is not viable)."""

    @properties.classproperty
    def priority(cls):  # noqa: N805
        raise RuntimeError("only for tests")

    def __init__(self, refuse: bool = False):
        super().__init__()
        self.items: dict[tuple[str, str], str] = {}
        self.refuse = refuse

    def get_password(self, service, username):
        return self.items.get((service, username))

    def set_password(self, service, username, password):
        if self.refuse:
            raise PasswordSetError("the keyring is locked")
        self.items[(service, username)] = password

    def delete_password(self, service, username):
        if self.items.pop((service, username), None) is None:
            raise PasswordDeleteError("no such key")


@pytest.fixture
def remote_window(make_window):
    """``make(keys=...)`` -> a window whose worker is a RemoteEngineWorker (nothing loaded yet)."""

    def make(keys: KeyStore | None = None):
        keys = keys or KeyStore(MemoryKeyring())
        w = make_window(worker=RemoteEngineWorker(keys=keys), load=False)
        w.generation_overrides = {"max_new_tokens": 24, "temperature": 0.0}
        return w

    return make


def _connect(qtbot, w, base_url: str, key: str, model: str = "") -> dict:
    """Connect through File > Connect to server… as a person would; returns the model info."""
    dialog = w.connector.open()
    dialog.url_edit.setText(base_url)
    dialog.key_edit.setText(key)
    with qtbot.waitSignal(dialog.models_listed, timeout=30_000) as listed:
        dialog.fetch_models(force=True)
    assert isinstance(listed.args[0], list), listed.args[0]
    if model:
        dialog.model_box.setEditText(model)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000) as loaded:
        dialog.connect_button.click()
    return loaded.args[0]


def _send(qtbot, w, text: str, timeout: int = 120_000) -> dict:
    with qtbot.waitSignal(w.reply_finished, timeout=timeout) as done:
        w.submit(text)
    return done.args[0]


def _server_stats(server) -> dict:
    r = httpx.get(server.base_url + "/attnchat/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    r.raise_for_status()
    return r.json()


# ---- no server needed ------------------------------------------------------------------------
def test_sources_name_a_server_and_a_model():
    assert normalize_base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url(" http://localhost:11434/v1/ ") == "http://localhost:11434/v1"
    assert normalize_base_url("https://example.org/v1/chat/completions") == "https://example.org/v1"
    for bad in ("", "ftp://host/v1", "http://host:port/v1"):
        with pytest.raises(ValueError):
            normalize_base_url(bad)
    src = remote_source("http://127.0.0.1:8000", "org/model:7b q4")
    assert is_remote_source(src) and not is_remote_source("/models/x.gguf")
    assert parse_remote_source(src) == ("http://127.0.0.1:8000/v1", "org/model:7b q4")
    assert source_label(src) == "org/model:7b q4 at 127.0.0.1:8000"
    assert source_label("/m/x.gguf") == "x.gguf" and source_label("") == "the default model"


def test_keys_go_to_the_keyring_or_stay_in_memory():
    backend = MemoryKeyring()
    keys = KeyStore(backend)
    assert keys.persistent and "system keyring" in keys.where()
    assert keys.set("http://h:1/v1/", "sk-1") is True
    assert backend.items == {(SERVICE, "http://h:1/v1"): "sk-1"}
    assert KeyStore(backend).get("http://h:1/v1") == "sk-1"   # a new session finds it
    keys.set("http://h:1/v1", "")
    assert backend.items == {} and KeyStore(backend).get("http://h:1/v1") == ""

    memory = KeyStore(None)
    assert not memory.persistent and "in memory until attnchat quits" in memory.where()
    assert memory.set("http://h:1/v1", "sk-2") is False and memory.get("http://h:1/v1") == "sk-2"

    locked = KeyStore(MemoryKeyring(refuse=True))  # the keyring refuses: memory, and it says so
    assert locked.set("http://h:1/v1", "sk-3") is False
    assert locked.get("http://h:1/v1") == "sk-3" and not locked.persistent and "memory" in locked.where()


def test_the_dialog_checks_the_address_and_says_where_the_key_goes(qtbot, remote_window):
    w = remote_window(KeyStore(None))
    dialog = w.connector.open()
    assert "in memory until attnchat quits" in dialog.key_note.text()
    dialog.url_edit.setText("ftp://nowhere")
    assert not dialog.connect_button.isEnabled() and "http" in dialog.list_status.text()
    dialog.url_edit.setText("127.0.0.1:9/v1")
    assert dialog.connect_button.isEnabled() and dialog.base_url() == "http://127.0.0.1:9/v1"
    dialog.reject()


def test_an_unreachable_server_is_reported_in_words(qtbot, remote_window):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = remote_window()
    with qtbot.waitSignal(w.engine.load_failed, timeout=30_000) as failed:
        w.load_model(remote_source(f"http://127.0.0.1:{port}/v1", "m"))
    message = failed.args[0]
    assert message.startswith(f"could not reach the server at http://127.0.0.1:{port}/v1"), message
    assert "refused" in message.lower() and "running" in message
    assert "could not reach the server" in w.notice.text() and not w.engine.model


# ---- against a real server -------------------------------------------------------------------
@pytest.mark.slow
def test_chat_through_the_server_with_usage_stats(qtbot, remote_window, server, tmp_path, monkeypatch):
    threads = []
    connect = RemoteModel.connect.__func__
    monkeypatch.setattr(RemoteModel, "connect", classmethod(
        lambda cls, *args: threads.append(threading.current_thread()) or connect(cls, *args)))
    backend = MemoryKeyring()
    w = remote_window(KeyStore(backend))
    info = _connect(qtbot, w, server.base_url, API_KEY)
    assert threads and threading.main_thread() not in threads   # the network waits off the GUI thread
    assert info["remote"] is True and info["name"].startswith("SmolLM2-135M-Instruct")
    assert info["context_limit"] == 2048 and info["base_url"] == server.base_url
    assert "SmolLM2" in w.status.model_label.text() and w.status.device_label.text().startswith("server 127.0.0.1:")

    result = _send(qtbot, w, FRANCE)
    assert result["reason"] == "stop" and "Paris" in result["text"], result
    stats = result["stats"]
    assert stats["remote"] is True and stats["prompt_tokens"] > 0 and stats["completion_tokens"] > 0
    assert stats["server_usage"]["total_tokens"] == stats["prompt_tokens"] + stats["completion_tokens"]
    assert stats["server_stats"]["finish_reason"] == "stop"   # attnchat's own figures come along
    assert stats["ttft_s"] > 0 and stats["context_used"] == stats["server_usage"]["total_tokens"]
    assert "Server usage:" in usage_text(stats) and "TTFT" in w.status.speed_label.text()
    reply = w.store.messages(w.current_conversation)[-1]
    assert reply.role == "assistant" and reply.content == result["text"] and reply.stats["remote"] is True

    # The conversation goes on: the server reuses its KV cache for the shared prefix.
    w.generation_overrides["max_new_tokens"] = 4
    follow = _send(qtbot, w, "And of Italy?")
    assert follow["reason"] in ("stop", "length") and follow["stats"]["reused_tokens"] > 0, follow["stats"]
    with qtbot.waitSignal(w.reply_finished, timeout=120_000) as done:   # greedy: the same reply again
        w.regenerate()
    assert done.args[0]["kind"] == "regenerate" and done.args[0]["text"] == follow["text"]
    assert [m.role for m in w.store.messages(w.current_conversation)] == ["user", "assistant"] * 2

    # The key is in the keyring, and never in the settings file; the source is.
    w.settings.sync()
    ini = (tmp_path / "settings.ini").read_text()
    assert API_KEY not in ini and "127.0.0.1" in ini
    assert backend.items[(SERVICE, server.base_url)] == API_KEY
    assert is_remote_source(w.settings.get("model/source")) and w.settings.get("remote/base_url") == server.base_url


@pytest.mark.slow
def test_stop_ends_the_reply_and_cancels_it_on_the_server(qtbot, remote_window, server):
    keys = KeyStore(None)
    keys.set(server.base_url, API_KEY)
    w = remote_window(keys)
    with qtbot.waitSignal(w.engine.model_loaded, timeout=30_000):
        w.load_model(remote_source(server.base_url, ""))   # "" = the server's first model
    cancelled_before = _server_stats(server)["finished"].get("cancelled", 0)
    w.generation_overrides = {"max_new_tokens": 1500, "temperature": 0.0}
    with qtbot.waitSignal(w.engine.text_batch, timeout=60_000):
        w.submit(LONG_ASK)
    t0 = time.monotonic()
    with qtbot.waitSignal(w.reply_finished, timeout=30_000) as done:
        w.stop_button.click()
    assert time.monotonic() - t0 < 5
    result = done.args[0]
    assert result["reason"] == "cancelled" and result["text"], result
    assert w.store.messages(w.current_conversation)[-1].finish_reason == "cancelled"
    deadline = time.monotonic() + 30
    while (s := _server_stats(server))["finished"].get("cancelled", 0) == cancelled_before:
        assert time.monotonic() < deadline, s
        qtbot.wait(100)
    assert s["last"][0]["finish_reason"] == "cancelled" and s["last"][0]["completion_tokens"] < 1500


@pytest.mark.slow
def test_a_wrong_key_and_an_unknown_model_are_reported_in_words(qtbot, remote_window, server):
    keys = KeyStore(None)
    keys.set(server.base_url, "wrong-key")
    w = remote_window(keys)
    with qtbot.waitSignal(w.engine.load_failed, timeout=30_000) as failed:
        w.load_model(remote_source(server.base_url, "SmolLM2-135M-Instruct.Q4_1"))
    assert failed.args[0].startswith(f"the server at {server.base_url} refused the API key (401: "), failed.args[0]
    assert "Connect to server" in failed.args[0] and "refused the API key" in w.notice.text()

    keys.set(server.base_url, API_KEY)
    with qtbot.waitSignal(w.engine.load_failed, timeout=30_000) as failed:
        w.load_model(remote_source(server.base_url, "no-such-model"))
    assert "has no model 'no-such-model' (it serves SmolLM2-135M-Instruct" in failed.args[0], failed.args[0]
