"""Ctrl-C on ``attnchat serve`` while a reply streams: the stream ends as a reply cut short (a
finish chunk with ``finish_reason`` "length", ``shutdown`` in the attnchat block, then
``data: [DONE]``), the server says it is stopping and that it stopped, and exits 0. A reply not
streamed returns what it wrote the same way when it had begun (batching: both decode), a 503 when
it still waited (one at a time: behind the stream). Before it,
on the same server: a conversation longer than the context is counted ``refused`` (a 400),
not ``failed``, and the attnchat block leaves out thread counts it did not measure (a batched
reply) instead of saying 0.

Each case is a real ``attnchat serve`` process on the default model (uvicorn's own shutdown
cut the stream after its 3 s grace: curl said "transfer closed with outstanding read data").
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.live_server import start_server

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a long story about a dragon who learns to read."}]


@pytest.mark.parametrize("parallel", ["4", "1"], ids=["batching", "one-at-a-time"])
def test_ctrl_c_ends_an_open_stream_with_a_finish_chunk_and_done(default_model_file, parallel):
    server = start_server("--model", str(default_model_file), "--parallel", parallel, "--context", "2048")
    events: list[str] = []
    first = threading.Event()
    failure: list[BaseException] = []

    model = ""
    whole: list[httpx.Response] = []

    def ask() -> None:
        body = {"model": model, "messages": STORY, "max_tokens": 2000, "temperature": 0}
        whole.append(httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120))

    def stats() -> dict:
        return httpx.get(f"{server.base_url}/attnchat/stats", timeout=30).json()

    def read() -> None:
        body = {"model": model, "messages": STORY, "max_tokens": 2000, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if '"content"' in line and '"content":""' not in line.replace(" ", ""):
                            first.set()
        except BaseException as e:  # a broken transfer: what the fix is against
            failure.append(e)
        finally:
            first.set()

    try:
        model = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"][0]["id"]
        long = [{"role": "user", "content": "word " * 3000}]
        r = httpx.post(f"{server.base_url}/chat/completions", json={"model": model, "messages": long}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        s = stats()
        assert (s["requests"], s["failed"], s["refused"]) == (1, 0, 1), s
        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(120), "no reply text arrived"
        assert not failure, failure
        asker = threading.Thread(target=ask)
        asker.start()
        deadline = time.monotonic() + 120
        # batching: both requests' prompts read (so both began); one at a time: the second waits
        while not (sum(1 for q in s.get("sequences", []) if not q["kept"] and q["tokens"] > 0) == 2
                   if parallel != "1" else s["queued"] == 1):
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
            s = stats()
        server.proc.send_signal(signal.SIGINT)
        reader.join(60)
        asker.join(60)
        status = server.proc.wait(timeout=60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    assert not reader.is_alive() and not failure, failure
    assert events[-1] == "[DONE]", events[-3:]
    finish = json.loads(events[-3])
    usage = json.loads(events[-2])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["attnchat"]["finish_reason"] == "shutdown"
    written = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-3])
    n = finish["attnchat"]["completion_tokens"]
    assert 0 < n < 2000 and written.strip()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n
    if parallel == "1":  # one session on the CPU: its governor's real counts
        assert finish["attnchat"]["max_threads"] >= finish["attnchat"]["decode_threads"] >= 1, finish["attnchat"]
    else:
        assert "decode_threads" not in finish["attnchat"] and "max_threads" not in finish["attnchat"]
    r = whole[0]
    if parallel == "1":
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
        assert r.json()["error"]["message"] == "The server is shutting down; the request was not answered."
    else:
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["choices"][0]["finish_reason"] == "length" and reply["attnchat"]["finish_reason"] == "shutdown"
        assert 0 < reply["usage"]["completion_tokens"] < 2000 and reply["choices"][0]["message"]["content"].strip()
    out = "".join(server.output)
    assert "attnchat: stopping; 2 replies in progress end here\n" in out, out
    assert out.endswith("attnchat: stopped\n"), out
    assert "Traceback" not in out and status == 0, (status, out)


def test_sigterm_on_an_idle_server_says_it_stopped(default_model_file):
    """uvicorn raises a SIGTERM again once it has shut down (the exit status says the signal): the
    lines come first. It printed nothing before."""
    server = start_server("--model", str(default_model_file), "--parallel", "1")
    try:
        server.proc.send_signal(signal.SIGTERM)
        status = server.proc.wait(timeout=60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    time.sleep(0.2)  # the pump thread reads the last lines
    out = "".join(server.output)
    assert status == -signal.SIGTERM and out.endswith("attnchat: stopping\nattnchat: stopped\n"), (status, out)
