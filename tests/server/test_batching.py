"""The batching engine (``attnchat serve --parallel N``) on a tiny seeded model: replies decoded
together equal the one-at-a-time engine's, a cancelled stream frees its pages at once, 40
concurrent requests are all answered, and the reuse rule holds for pages; ``--parallel auto``'s
plan; on the default GGUF, replies batched equal each alone."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx2 as httpx
import pytest

from attnchat.server.app import create_app
from attnchat.server.batching import (
    MAX_QUEUED,
    MAX_QUEUED_AUTO,
    PARALLEL,
    QUEUED_BYTES,
    RESERVE_BYTES,
    BatchEngine,
    plan,
)
from attnchat.server.engine import POOL_BYTES, Delta, Done, Engine, Job
from runtime import GenerationSettings, Message, SamplingParams, load_model
from tests.runtime.tiny_models import WORDS, make_tiny_model

SETTINGS = GenerationSettings(context_limit=128, overflow="stop")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("batching"), "llama"), device="cpu", dtype="float32",
                      threads=1)


def _job(user: str, history=(), max_tokens: int = 8, **kw) -> tuple[Job, list, threading.Event]:
    items: list = []
    done = threading.Event()
    job = Job(system=None, messages=[*history, Message("user", user)],
              emit=lambda item: (items.append(item), isinstance(item, Done) and done.set()),
              sampling=SamplingParams(temperature=0), max_tokens=max_tokens, **kw)
    return job, items, done


def _done(items) -> Done:
    return next(i for i in items if isinstance(i, Done))


ASKS = [" ".join(WORDS[i : i + 3 + i % 5]) for i in range(0, 36, 6)]


def test_replies_together_equal_the_one_at_a_time_engine(tiny):
    serial = Engine(tiny, settings=SETTINGS, sessions=1)
    batched = BatchEngine(tiny, settings=SETTINGS, parallel=4)
    try:
        want = []
        for ask in ASKS:
            job, items, done = _job(ask)
            serial.submit(job)
            assert done.wait(60)
            want.append(_done(items))
        jobs = [_job(ask) for ask in ASKS]
        for job, _, _ in jobs:
            batched.submit(job)
        for (job, items, done), w in zip(jobs, want):
            assert done.wait(60)
            got = _done(items)
            assert (got.reason, got.token_ids, got.text) == (w.reason, w.token_ids, w.text)
            assert got.stats.prompt_tokens == w.stats.prompt_tokens
            assert "".join(i.text for i in items if isinstance(i, Delta)) == got.text
        stats = batched.stats()
        assert stats["decoded_rows"] > stats["decode_steps"]  # some steps decoded several rows
        assert sum(stats["finished"].values()) == len(ASKS)
        # Only the finished replies kept for their next turns hold pages.
        assert stats["running"] == 0 and stats["pages"]["pages_used"] == sum(
            s.stats()["pages"] for s in batched._kept) > 0
        # each kept sequence, as the Server panel draws them
        assert [(s["kept"], s["pages"]) for s in stats["sequences"]] == [(True, q.stats()["pages"]) for q in batched._kept]
        assert stats["kv_allocated_bytes"] > 0
    finally:
        serial.close()
        batched.close()


def test_a_cancelled_stream_frees_its_pages_at_once(tiny):
    engine = BatchEngine(tiny, settings=SETTINGS, parallel=2)
    try:
        first_piece = threading.Event()
        job, items, done = _job("who are you and what do they have", max_tokens=100)
        inner = job.emit
        job.emit = lambda item: (inner(item), isinstance(item, Delta) and first_piece.set())
        other, other_items, other_done = _job("how", max_tokens=100)
        engine.submit(job)
        engine.submit(other)
        assert first_piece.wait(60)
        deadline = time.monotonic() + 30  # the figures are the last step's: the next one has it
        while job.id not in (running := {s["id"]: s for s in engine.stats()["sequences"] if not s["kept"]}):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert running[job.id]["pages"] >= 1 and running[job.id]["tokens"] >= 8  # its prompt, at least
        engine.cancel(job)
        assert done.wait(60) and _done(items).reason == "cancelled"
        engine.cancel(other)
        assert other_done.wait(60)
        assert engine.stats()["pages"]["pages_used"] == 0
        assert engine.pool.stats()["pages_used"] == 0
    finally:
        engine.close()


def test_another_conversation_never_reuses_pages(tiny):
    engine = BatchEngine(tiny, settings=SETTINGS, parallel=2)

    def run(user, history=()):
        job, items, done = _job(user, history)
        engine.submit(job)
        assert done.wait(60)
        return _done(items)

    try:
        victim = run("my bank pin is what " * 4)
        assert victim.stats.prompt_tokens > 32
        for probe in ("my bank pin is what " * 3, "my bank pin is what " * 4 + "and"):
            assert run(probe).stats.reused_tokens == 0, probe
        # The same client's next turn, resending its conversation, reuses its prompt and reply
        # (the finished sequence was kept: partial pages too).
        history = [Message("user", "my bank pin is what " * 4), Message("assistant", victim.text)]
        again = run("and then", history)
        assert victim.stats.prompt_tokens < again.stats.reused_tokens < victim.stats.prompt_tokens + len(victim.token_ids)
    finally:
        engine.close()


def test_forty_concurrent_requests_are_all_answered(tiny):
    app = create_app(tiny, settings=SETTINGS, parallel=4)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     timeout=120) as c:
            async def ask(i):
                body = {"model": tiny.name, "max_tokens": 4, "messages": [{"role": "user", "content": ASKS[i % 6]}]}
                if i % 3 == 0:
                    body |= {"logprobs": True, "top_logprobs": 2}
                return await c.post("/v1/chat/completions", content=json.dumps(body),
                                    headers={"Content-Type": "application/json"})
            return await asyncio.gather(*(ask(i) for i in range(40)))

    try:
        responses = asyncio.run(go())
        assert [r.status_code for r in responses] == [200] * 40
        texts = {}
        for i, r in enumerate(responses):
            choice = r.json()["choices"][0]
            texts.setdefault(i % 6, set()).add(choice["message"]["content"])
            if i % 3 == 0:
                assert len(choice["logprobs"]["content"]) == r.json()["usage"]["completion_tokens"]
        assert all(len(t) == 1 for t in texts.values())  # greedy: one reply per question
        stats = app.state.engine.stats()
        assert stats["refused"] == 0 and stats["requests"] == 40 and stats["parallel"] == 4
    finally:
        app.state.engine.close()


def _within(seconds: float, call):
    """``call()``'s result, on a thread of its own: a worker stuck holding the engine's lock
    would block the caller (the HTTP side) for ever, so the test fails instead."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"{call} did not return within {seconds} s: the engine's lock is held"
    return out[0]


def test_an_idle_pool_is_freed_and_the_next_request_answered(tiny):
    """After ``pool_idle_s`` without a request the pool's arenas are freed, and the engine
    still answers: the freeing once ran holding the lock it then took again (a server left
    idle for 10 s answered nothing more, not even its stats)."""
    engine = BatchEngine(tiny, settings=SETTINGS, parallel=2, pool_idle_s=0.2)
    job, items, done = _job(ASKS[0])
    engine.submit(job)
    assert done.wait(60)
    first = _done(items)
    deadline = time.monotonic() + 30
    while _within(5, engine.stats)["kv_allocated_bytes"]:
        assert time.monotonic() < deadline, "the idle pool was never freed"
        time.sleep(0.05)
    assert engine.pool.allocated_bytes == 0 and not engine._kept
    job, items, done = _job(ASKS[0])
    _within(5, lambda: engine.submit(job))
    assert done.wait(60)
    again = _done(items)
    assert (again.reason, again.token_ids) == (first.reason, first.token_ids) and again.stats.reused_tokens == 0
    _within(10, engine.close)


def test_parallel_needs_the_stop_policy(tiny):
    with pytest.raises(ValueError, match="overflow stop"):
        BatchEngine(tiny, settings=GenerationSettings(context_limit=128, overflow="rolling"))


def test_kept_sequences_give_their_pages_back_when_the_pool_needs_them(tiny):
    """A pool of 24 pages of 16 tokens: each reply's worst case takes 3-4, the eight replies
    kept after them hold more than the pool has, and every one is still answered."""
    per_page = BatchEngine(tiny, settings=SETTINGS, parallel=1).pool.bytes_per_page
    engine = BatchEngine(tiny, settings=SETTINGS, parallel=2, pool_bytes=24 * per_page)
    try:
        engine.keep = 8
        dones = []
        for i in range(10):
            job, items, done = _job(" ".join(WORDS[i * 4 : i * 4 + 12]), max_tokens=20)
            engine.submit(job)
            assert done.wait(60)
            dones.append(_done(items))
        assert all(d.reason in ("length", "stop") for d in dones)
        pages = engine.stats()["pages"]
        assert pages["pages_total"] <= 24 and len(engine._kept) <= 8
    finally:
        engine.close()


# ---- serve --parallel auto --------------------------------------------------------------
LOOSE = 16 << 30  # free bytes of a machine with room to spare


def test_auto_batches_on_a_loose_memory_cpu(tiny):
    how = plan(tiny, SETTINGS, free_bytes=LOOSE)
    whole = BatchEngine(tiny, settings=SETTINGS, parallel=1).pool.bytes_for(128)
    assert (how.parallel, how.pool_bytes, how.max_queued) == (PARALLEL, POOL_BYTES, MAX_QUEUED_AUTO)
    assert f"{PARALLEL} replies decode together" in how.reason and f"room for {POOL_BYTES // whole} whole 128-token conversations" in how.reason
    # the queue from the memory left after the pool: 100 waiting requests' worth
    tight = POOL_BYTES + RESERVE_BYTES + 100 * QUEUED_BYTES
    assert plan(tiny, SETTINGS, free_bytes=tight).max_queued == 100
    assert plan(tiny, SETTINGS, free_bytes=tight, max_queued=7).max_queued == 7
    assert plan(tiny, SETTINGS, free_bytes=POOL_BYTES + RESERVE_BYTES).max_queued == MAX_QUEUED
    # a context whose one conversation passes 256 MiB gets a pool that holds it
    big = BatchEngine(tiny, settings=GenerationSettings(overflow="stop"), parallel=1).pool
    assert plan(tiny, GenerationSettings(overflow="stop"), free_bytes=LOOSE).pool_bytes == max(
        POOL_BYTES, big.bytes_for(tiny.config.max_position_embeddings))


@pytest.mark.parametrize("settings, free, pool, said", [
    (GenerationSettings(context_limit=128, overflow="rolling"), LOOSE, None, "--overflow rolling"),
    (GenerationSettings(context_limit=128, overflow="truncate-middle"), LOOSE, None, "--overflow truncate-middle"),
    (GenerationSettings(context_limit=128, overflow="stop", cache_policy="h2o", cache_budget=64), LOOSE, None,
     "--cache-policy h2o"),
    (SETTINGS, 600 << 20, None, "MiB free does not hold a 256 MiB KV pool"),
    (SETTINGS, LOOSE, 1024, "holds less than one 128-token conversation"),
])
def test_auto_is_one_at_a_time_with_a_setting_batching_cannot_take(tiny, settings, free, pool, said):
    how = plan(tiny, settings, free_bytes=free, pool_bytes=pool)
    assert how.parallel == 1 and how.max_queued is None
    assert how.reason.startswith("one request at a time: ") and said in how.reason and "\n" not in how.reason
    assert how.pool_bytes == (POOL_BYTES if pool is None else pool)  # the idle sessions' budget as before


def test_an_asked_parallel_that_cannot_work_is_one_line(tiny):
    with pytest.raises(ValueError, match=r"^--parallel 4: 600 MiB free does not hold") as e:
        plan(tiny, SETTINGS, parallel=4, free_bytes=600 << 20)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^--parallel 2: batching needs --overflow stop, not --overflow rolling; or drop --parallel$"):
        plan(tiny, GenerationSettings(context_limit=128, overflow="rolling"), parallel=2, free_bytes=LOOSE)
    # asked, a small pool is the user's: longer conversations are refused, not the server
    assert plan(tiny, SETTINGS, parallel=2, pool_bytes=1 << 20, free_bytes=LOOSE).parallel == 2
    assert plan(tiny, SETTINGS, parallel=1, free_bytes=LOOSE).reason == "one request at a time: --parallel 1"
    assert plan(tiny, SETTINGS, free_bytes=None).parallel == PARALLEL  # memory unknown: as the engine would


# ---- the default model as `attnchat serve` loads it (its Q4_1 blocks, ggml's products) ---
@pytest.fixture(scope="module")
def default_blocks(default_model_file):
    return load_model(default_model_file, device="cpu")


DEFAULT_ASKS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                "Name a colour and a fruit."]


@pytest.mark.slow
def test_default_gguf_replies_batched_equal_each_alone(default_blocks):
    """Four greedy replies decoding together give each one's token ids as it gets alone on the
    same server (a batch of one-token rows takes the decode kernel, row-invariant)."""
    settings = GenerationSettings(context_limit=1024, overflow="stop")
    engine = BatchEngine(default_blocks, settings=settings, parallel=4)
    try:
        alone = []
        for ask in DEFAULT_ASKS:
            job, items, done = _job(ask, max_tokens=24)
            engine.submit(job)
            assert done.wait(120)
            alone.append(_done(items).token_ids)
        before = engine.stats()
        jobs = [_job(ask, max_tokens=24) for ask in DEFAULT_ASKS]
        for job, _, _ in jobs:
            engine.submit(job)
        together = []
        for job, items, done in jobs:
            assert done.wait(120)
            together.append(_done(items).token_ids)
        after = engine.stats()
        rows, steps = (after[k] - before[k] for k in ("decoded_rows", "decode_steps"))
        # they did decode together: more than 1.5 rows a step (one at a time: under one, the
        # prompts' steps decode none; the replies' lengths depend on the kernels the load allowed)
        assert rows > 1.5 * steps, (rows, steps)
        assert together == alone and min(len(t) for t in alone) >= 5
    finally:
        engine.close()


@pytest.mark.slow
def test_default_gguf_replies_are_the_same_one_at_a_time_and_batched(default_blocks):
    """The one-at-a-time engine (the one-sequence ggml token over a contiguous cache) and the
    batching engine (rows as one ggml graph over pages) give the same greedy token ids: each
    row's hidden state is the one-sequence graph's, only the LM head's exact top logits can
    differ (by ~1e-8); with the blocks' default float16 cache and pool."""
    settings = GenerationSettings(context_limit=1024, overflow="stop")
    serial = Engine(default_blocks, settings=settings, sessions=1)
    batched = BatchEngine(default_blocks, settings=settings, parallel=4)
    try:
        want = []
        for ask in DEFAULT_ASKS:
            job, items, done = _job(ask, max_tokens=24)
            serial.submit(job)
            assert done.wait(120)
            want.append(_done(items).token_ids)
        jobs = [_job(ask, max_tokens=24) for ask in DEFAULT_ASKS]
        for job, _, _ in jobs:
            batched.submit(job)
        for (job, items, done), w in zip(jobs, want):
            assert done.wait(120)
            assert _done(items).token_ids == w
        assert batched.batcher._ggml, "the batched rows did not run as one graph"
    finally:
        serial.close()
        batched.close()
