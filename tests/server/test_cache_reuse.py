"""What one request reuses of another's KV cache: up to the end of the
longest earlier prompt it extends plus the part of the model's reply it repeats, never a
partial earlier prompt, never across API keys. Engine and app on a tiny seeded model; a
client's usual flow (replies sent back stripped) on the real server."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx2 as httpx
import pytest

from attnchat.server.app import create_app
from attnchat.server.engine import Done, Engine, Job
from runtime import GenerationSettings, Message, SamplingParams, load_model
from tests.runtime.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


@pytest.fixture()
def engine(tiny):
    e = Engine(tiny, settings=GenerationSettings(context_limit=128), sessions=2)
    yield e
    e.close()


def _ask(engine: Engine, messages: list[Message], *, partition: str = "", max_tokens: int = 6) -> Done:
    items, done = [], threading.Event()
    job = Job(system=None, messages=list(messages), emit=lambda i: (items.append(i), isinstance(i, Done) and done.set()),
              sampling=SamplingParams(temperature=0), max_tokens=max_tokens, partition=partition)
    engine.submit(job)
    assert done.wait(60)
    return next(i for i in items if isinstance(i, Done))


def test_the_same_request_twice_reuses_its_whole_prompt(engine):
    ask = [Message("user", "who are you and what do you do")]
    first = _ask(engine, ask)
    again = _ask(engine, ask)
    assert first.stats.reused_tokens == 0
    assert again.stats.reused_tokens == again.stats.prompt_tokens == first.stats.prompt_tokens
    assert again.token_ids == first.token_ids  # greedy: the logits its prefill left


def test_a_reply_sent_back_changed_reuses_up_to_where_it_differs(engine, tiny):
    u1 = Message("user", "what is it and how")
    first = _ask(engine, [u1], max_tokens=8)
    assert len(first.token_ids) >= 4
    # the client sends the reply back cut short (as .strip() cuts whitespace)
    shown = tiny.decode(first.token_ids[:-2])
    second = _ask(engine, [u1, Message("assistant", shown), Message("user", "and then")])
    p1 = first.stats.prompt_tokens
    assert p1 < second.stats.reused_tokens <= p1 + len(first.token_ids)
    # a third turn that sends both replies back changed still extends the first prompt
    third = _ask(engine, [u1, Message("assistant", shown + "!"), Message("user", "and then"),
                          Message("assistant", "no"), Message("user", "why")])
    assert third.stats.reused_tokens >= p1


def test_a_partial_earlier_prompt_is_never_reused(engine, tiny):
    """A timing probe for another client's prompt, against the second prompt of a conversation: a client that
    knows the first turn whole may reuse it and its reply, but not a token of the secret
    second message."""
    u1 = Message("user", "who are you")
    first = _ask(engine, [u1])
    a1 = Message("assistant", tiny.decode(first.token_ids))
    victim = _ask(engine, [u1, a1, Message("user", "my bank pin is what")])
    cap = first.stats.prompt_tokens + len(first.token_ids)
    for guess in ("my bank pin is", "my bank pin is wh"):
        probe = _ask(engine, [u1, a1, Message("user", guess)])
        assert probe.stats.reused_tokens <= cap, guess
    assert victim.stats.reused_tokens >= first.stats.prompt_tokens


def test_different_keys_never_share_a_cache(engine):
    ask = [Message("user", "who are you and what do you do")]
    _ask(engine, ask, partition="key0")
    assert _ask(engine, ask, partition="key1").stats.reused_tokens == 0
    assert _ask(engine, ask, partition="key0").stats.reused_tokens > 0


def test_the_app_partitions_by_the_key_a_request_came_with(tiny):
    app = create_app(tiny, api_key=["alpha-key", "beta-key"], settings=GenerationSettings(context_limit=128))
    body = {"model": tiny.name, "max_tokens": 4, "messages": [{"role": "user", "content": "who are you"}]}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            out = []
            for key in ("alpha-key", "beta-key", "alpha-key", "gamma-key"):
                r = await c.post("/v1/chat/completions", content=json.dumps(body),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
                out.append(r)
            return out

    try:
        a, b, a2, bad = asyncio.run(go())
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (a, b, a2)]
        assert cached[0] == 0 and cached[1] == 0 and cached[2] == a.json()["usage"]["prompt_tokens"]
        assert bad.status_code == 401
    finally:
        app.state.engine.close()


# ---- the real server ------------------------------------------------------------------------
@pytest.mark.slow
def test_stripped_replies_keep_the_reuse(client, model_id):
    """A client's usual flow with the official client: turn 3 sends both replies back stripped of
    a character and still reuses at least turn 1's prompt; the same request sent twice reuses
    all of its prompt the second time, with the same text."""
    sys_msg = {"role": "system", "content": "Answer in one short sentence."}
    u1 = {"role": "user", "content": "Name a fruit that is red."}

    def ask(messages):
        r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=12, temperature=0)
        return r.choices[0].message.content, r.usage

    a1, use1 = ask([sys_msg, u1])
    u2 = {"role": "user", "content": "Name one that is yellow."}
    turn2 = [sys_msg, u1, {"role": "assistant", "content": a1}, u2]
    a2, use2 = ask(turn2)
    assert use2.prompt_tokens_details.cached_tokens >= use1.prompt_tokens
    cut = lambda s: s.strip()[:-1]  # noqa: E731 - at least one character off, as a strip may take
    u3 = {"role": "user", "content": "And a green one?"}
    _, use3 = ask([sys_msg, u1, {"role": "assistant", "content": cut(a1)}, u2,
                   {"role": "assistant", "content": cut(a2)}, u3])
    assert use3.prompt_tokens_details.cached_tokens >= use1.prompt_tokens
    once_text, _ = ask(turn2)
    twice_text, twice = ask(turn2)
    assert twice.prompt_tokens_details.cached_tokens == twice.prompt_tokens
    assert twice_text == once_text
