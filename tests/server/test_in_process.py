"""The server for a model already loaded in this process (attnchat.server.in_process): it serves
the very object it is given (no second load), a chat on the same model in this process while it
answers gives the same greedy replies as each alone, and stopping it frees its port."""
from __future__ import annotations

import json
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


def test_stopping_mid_stream_ends_the_stream_with_its_finish_chunk(tiny):
    server = InProcessServer(tiny, settings=SETTINGS, parallel=1)
    url = server.start()
    # each piece sent 20 ms late, so the 100 tokens take 2 s and the stop lands mid-reply on a busy machine too
    send = server.engine._send
    server.engine._send = lambda job, item: (time.sleep(0.02), send(job, item))
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/chat/completions", timeout=60, json={
                "model": tiny.name, "messages": [{"role": "user", "content": ASK_SERVER}], "max_tokens": 100,
                "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    server.stop()
    t.join(30)
    assert not t.is_alive() and not server.serving
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    last = chunks[-1]
    # cut by the stop, as `attnchat serve`'s Ctrl-C cuts one: OpenAI's "length", attnchat's "shutdown"
    assert last["choices"][0]["finish_reason"] == "length" and last["attnchat"]["finish_reason"] == "shutdown"
    assert last["attnchat"]["completion_tokens"] < 100
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_more_host_names_are_answered_beside_the_bound_one(tiny):
    server = InProcessServer(tiny, settings=SETTINGS, parallel=1, allowed_hosts=["chat.lan"])
    url = server.start()
    try:
        assert httpx.get(f"{url}/models", headers={"Host": "chat.lan"}, timeout=30).status_code == 200
        assert httpx.get(f"{url}/models", headers={"Host": "evil.example"}, timeout=30).status_code != 200
    finally:
        server.stop()
