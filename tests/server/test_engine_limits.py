"""The server's engine and app on a tiny seeded model (fast, no HTTP socket): the bounded
queue (429 + Retry-After, cancelled jobs dropped), no KV-cache reuse across conversations
(else a client could learn another's prompt from its timing), the max_tokens ceiling, the access log without query strings.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx2 as httpx
import pytest

from attnchat.server.app import create_app
from attnchat.server.engine import Done, Engine, Job, QueueFullError
from attnchat.server.guard import drop_query_strings
from runtime import GenerationSettings, Message, SamplingParams, load_model
from tests.runtime.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def _job(user: str, history=(), max_tokens: int = 2, emit=None) -> tuple[Job, list]:
    items: list = []
    job = Job(system=None, messages=[*history, Message("user", user)], emit=emit or items.append,
              sampling=SamplingParams(temperature=0), max_tokens=max_tokens)
    return job, items


def _run(engine: Engine, job: Job, items: list) -> Done:
    done = threading.Event()
    inner = job.emit
    job.emit = lambda item: (inner(item), isinstance(item, Done) and done.set())
    engine.submit(job)
    assert done.wait(60)
    return next(i for i in items if isinstance(i, Done))


def test_another_conversation_never_reuses_a_cache(tiny):
    """The probe shares its first 30 tokens with the victim's prompt; it must get none of them."""
    engine = Engine(tiny, settings=GenerationSettings(context_limit=128), sessions=1)
    try:
        victim = _run(engine, *_job("my bank pin is what"))
        assert victim.stats.prompt_tokens > 8
        for probe in ("my bank pin is", "my bank pin is wh"):
            got = _run(engine, *_job(probe))
            assert got.stats.reused_tokens == 0, probe
        # The same client's next turn, resending its whole conversation, still reuses it.
        first = _run(engine, *_job("who are you"))
        history = [Message("user", "who are you"), Message("assistant", first.text)]
        second = _run(engine, *_job("and then what", history))
        assert second.stats.reused_tokens >= first.stats.prompt_tokens
    finally:
        engine.close()


def test_an_idle_session_keeps_only_the_cache_it_needs(tmp_path, monkeypatch):
    """A long conversation (a 512-slot cache), then a short one on the same pooled session
    (reset: the long one's buffers stay allocated): once idle, the cache shrinks to one
    256-token chunk, and the freed memory is handed back to the OS."""
    from attnchat.server import engine as serve_engine

    trims: list[int] = []
    monkeypatch.setattr(serve_engine, "trim_heap", lambda: trims.append(1))
    model = load_model(make_tiny_model(tmp_path, "llama", max_positions=1024), device="cpu", dtype="float32")
    engine = Engine(model, settings=GenerationSettings(context_limit=1024), sessions=1, pool_bytes=1 << 30)
    try:
        per_token = engine._pool[0].cache.bytes_per_token

        def trimmed(n: int) -> None:  # the pool is trimmed after the reply was sent
            deadline = time.monotonic() + 30
            while len(trims) < n:
                assert time.monotonic() < deadline, "the heap was not given back"
                time.sleep(0.01)

        long = _run(engine, *_job("who are you " * 60))
        assert 256 < long.stats.prompt_tokens < 500
        trimmed(1)  # after a prefill over 256 tokens
        assert engine.memory()["kv_allocated_bytes"] == 512 * per_token  # it holds all of them
        short = _run(engine, *_job("who"))
        assert short.stats.reused_tokens == 0
        trimmed(2)  # the shrink freed bytes
        held = short.stats.prompt_tokens + short.stats.completion_tokens
        assert engine.memory() == {"kv_used_bytes": pytest.approx(held * per_token, abs=per_token),
                                   "kv_allocated_bytes": 256 * per_token}
    finally:
        engine.close()


def test_the_queue_is_bounded_and_a_cancelled_job_leaves_it(tiny):
    engine = Engine(tiny, settings=GenerationSettings(context_limit=128), sessions=1, max_queued=2)
    gate, started = threading.Event(), threading.Event()
    try:
        # The first job holds the worker: its first item blocks until the gate opens.
        busy, _ = _job("who are you", emit=lambda item: (started.set(), gate.wait(30)))
        engine.submit(busy)
        assert started.wait(30)
        (a, a_items), (b, _) = _job("a " * 1000), _job("b")
        engine.submit(a)
        engine.submit(b)
        with pytest.raises(QueueFullError):
            engine.submit(_job("c")[0])
        assert engine.stats()["queued"] == 2 and engine.stats()["refused"] == 1
        engine.cancel(a)  # its client left: out of the queue now, not at its turn
        assert engine.stats()["queued"] == 1 and a not in engine._jobs
        assert [type(i).__name__ for i in a_items] == ["Done"] and a_items[0].reason == "cancelled"
        engine.submit(_job("d")[0])  # room again
        assert engine.stats()["queued"] == 2
    finally:
        gate.set()
        engine.close()


def _post(app, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return await c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    return asyncio.run(go())


def test_a_full_queue_is_a_429_with_retry_after(tiny):
    app = create_app(tiny, settings=GenerationSettings(context_limit=128), max_queued=0)
    try:
        r = _post(app, {"model": tiny.name, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        app.state.engine.close()


def test_max_tokens_has_a_ceiling(tiny):
    app = create_app(tiny, settings=GenerationSettings(context_limit=128), max_tokens_limit=64)
    try:
        for field in ("max_tokens", "max_completion_tokens"):
            r = _post(app, {"model": tiny.name, field: 65, "messages": [{"role": "user", "content": "hi"}]})
            err = r.json()["error"]
            assert r.status_code == 400 and (err["param"], err["code"]) == (field, "invalid_value"), r.text
            assert "64" in err["message"]
        assert app.state.engine.stats()["requests"] == 0
    finally:
        app.state.engine.close()


def test_the_access_log_keeps_no_query_string():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/models?api_key=sk-secret", "1.1", 200), None)
    assert drop_query_strings(record) is True
    assert record.getMessage() == '127.0.0.1:5 - "GET /v1/models HTTP/1.1" 200'


def test_after_the_idle_time_the_pooled_caches_are_given_back(tiny, monkeypatch):
    """A burst of one-off conversations fills the pool; once no request has come for
    pool_idle_s, every cache is freed and the heap trimmed, and the next request still
    answers (prefilling again)."""
    from attnchat.server import engine as serve_engine

    trims: list[int] = []
    monkeypatch.setattr(serve_engine, "trim_heap", lambda: trims.append(1))
    engine = Engine(tiny, settings=GenerationSettings(context_limit=128), sessions=3, pool_idle_s=0.2)
    try:
        first = _run(engine, *_job("one"))
        for text in ("two", "three"):
            _run(engine, *_job(text))
        deadline = time.monotonic() + 60  # a hang detector: the release comes 0.2 s after the last reply
        while engine.memory()["kv_allocated_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.memory() == {"kv_used_bytes": 0, "kv_allocated_bytes": 0} and trims
        again = _run(engine, *_job("one"))
        assert again.text == first.text and again.stats.reused_tokens == 0
    finally:
        engine.close()


def test_the_idle_time_can_be_switched_off_and_its_default_is_the_command_lines(tiny):
    from attnchat.server import command, engine as serve_engine

    assert Engine(tiny, pool_idle_s=0).pool_idle_s is None
    parser = __import__("argparse").ArgumentParser()
    command.add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).pool_idle_s == serve_engine.POOL_IDLE_S
