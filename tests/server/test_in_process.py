"""The server for a model already loaded in this process (attnchat.server.in_process): it serves
the very object it is given (no second load), a chat on the same model in this process while it
answers gives the same greedy replies as each alone, and stopping it frees its port."""
from __future__ import annotations

import socket
import threading
import time

import httpx2 as httpx
import pytest

from attnchat.server.in_process import InProcessServer
from runtime import GenerationSettings, Message, SamplingParams, load_model
from runtime.generate.events import Finish
from runtime.generate.session import ChatSession
from tests.runtime.tiny_models import WORDS, make_tiny_model

SETTINGS = GenerationSettings(context_limit=128, overflow="stop")
ASK_SERVER = " ".join(WORDS[:6])
ASK_CHAT = " ".join(WORDS[10:15])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("in_process"), "llama"), device="cpu",
                      dtype="float32", threads=1)


def _chat(model, ask: str, tokens: int, context: int = 128) -> tuple[int, ...]:
    """A greedy reply as the desktop's chat makes one: a ChatSession on this thread."""
    s = ChatSession(model, settings=GenerationSettings(context_limit=context, sampling=SamplingParams(temperature=0),
                                                       max_new_tokens=tokens))
    s.messages = [Message("user", ask)]
    return next(e for e in s.reply() if isinstance(e, Finish)).token_ids


def _ask(url: str, ask: str, tokens: int, model: str) -> dict:
    r = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": ask}], "max_tokens": tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("parallel", [1, 2])
def test_it_serves_the_loaded_model_itself_and_stops(tiny, parallel):
    server = InProcessServer(tiny, settings=SETTINGS, parallel=parallel)
    url = server.start()
    try:
        assert server.serving and server.engine.model is tiny   # the same object: no second copy
        assert type(server.engine).__name__ == ("BatchEngine" if parallel > 1 else "Engine")
        models = httpx.get(f"{url}/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [tiny.name]
        reply = _ask(url, ASK_SERVER, 8, tiny.name)
        assert reply["usage"]["completion_tokens"] == 8
        # the reply's text is the one a chat in this process writes for the same ask
        want = tiny.tokenizer.decode(list(_chat(tiny, ASK_SERVER, 8)))
        assert reply["choices"][0]["message"]["content"] == want
    finally:
        server.stop()
    assert not server.serving
    host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()
    server.stop()  # twice is harmless


def test_a_chat_while_it_serves_gets_the_replies_each_gets_alone(default_model_file):
    """On the default GGUF as the window loads it (its ggml decode graphs): the chat on this
    thread and a request on the server's thread, decoding at the same time, give the greedy
    tokens each gives alone."""
    model = load_model(default_model_file, device="cpu")
    alone_chat = _chat(model, "Name three colours.", 24)
    server = InProcessServer(model, settings=GenerationSettings(context_limit=512, overflow="stop"), parallel=1)
    url = server.start()
    try:
        alone_server = _ask(url, "Count from one to ten.", 24, model.name)["choices"][0]["message"]["content"]
        got: dict = {}

        def ask() -> None:
            got["start"] = time.monotonic()
            got["r"] = _ask(url, "Count from one to ten.", 24, model.name)
            got["end"] = time.monotonic()

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(0.05)
        start = time.monotonic()
        together_chat = _chat(model, "Name three colours.", 24)
        end = time.monotonic()
        t.join(120)
        assert got["start"] < end and start < got["end"], "the two replies did not decode at the same time"
        assert together_chat == alone_chat
        assert got["r"]["choices"][0]["message"]["content"] == alone_server
    finally:
        server.stop()


def test_it_refuses_a_lan_address_without_a_key(tiny):
    with pytest.raises(ValueError, match="without an API key"):
        InProcessServer(tiny, host="0.0.0.0", settings=SETTINGS)
