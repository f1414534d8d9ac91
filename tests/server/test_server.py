"""``attnchat serve`` end to end: a real server process, the official ``openai`` client, raw HTTP for errors.

The shared server (session scope, see conftest) answers every test here; replies are kept to
a few tokens because the suite runs on a small shared CPU.
"""
from __future__ import annotations

import threading
import time

import httpx2 as httpx
import openai
import pytest

from tests.live_server import API_KEY

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def france(client, model_id):
    """The greedy, non-streamed answer to FRANCE (shared by the tests that compare against it)."""
    return client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=24)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_binds_to_loopback_by_default(server):
    assert server.base_url.startswith("http://127.0.0.1:")


def test_lists_the_model(client, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id] and model_id.startswith("SmolLM2-135M-Instruct")
    assert client.models.retrieve(model_id).id == model_id


def test_answers_with_usage(france):
    choice = france.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    u = france.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_stream_matches_the_whole_reply(client, model_id, france):
    chunks = list(client.chat.completions.create(
        model=model_id, messages=FRANCE, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == france.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == france.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_second_turn_reuses_the_first(client, model_id):
    turn1 = [{"role": "system", "content": "Answer in one short sentence."},
             {"role": "user", "content": "Name a primary colour."}]
    first = client.chat.completions.create(model=model_id, messages=turn1, max_tokens=12)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Name another one."}]
    second = client.chat.completions.create(model=model_id, messages=turn2, max_tokens=12)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The whole first prompt and the reply come from the cache: the reply the client sent
    # back is the text this server wrote, so its token ids are spliced, not re-tokenized
    # (a max_tokens stop feeds its last token at the stop, so that one is cached too).
    assert second.usage.prompt_tokens_details.cached_tokens == (
        first.usage.prompt_tokens + first.usage.completion_tokens)
    assert second.attnchat["retokenized_tokens"] == 0
    assert second.attnchat["reused_tokens"] == second.usage.prompt_tokens_details.cached_tokens
    assert second.attnchat["prefilled_tokens"] == second.usage.prompt_tokens - second.attnchat["reused_tokens"]


def test_interleaved_conversations_keep_their_caches(client, model_id):
    """Two clients take turns: each conversation stays in its own pooled session."""
    def ask(messages):
        return client.chat.completions.create(model=model_id, messages=messages, max_tokens=6)

    a = [{"role": "user", "content": "Name a fruit."}]
    b = [{"role": "user", "content": "Name a planet."}]
    a1, b1 = ask(a), ask(b)
    a2 = ask(a + [{"role": "assistant", "content": a1.choices[0].message.content},
                  {"role": "user", "content": "Another one?"}])
    b2 = ask(b + [{"role": "assistant", "content": b1.choices[0].message.content},
                  {"role": "user", "content": "Another one?"}])
    assert a2.usage.prompt_tokens_details.cached_tokens >= a1.usage.prompt_tokens
    assert b2.usage.prompt_tokens_details.cached_tokens >= b1.usage.prompt_tokens


def test_stop_sequence(client, model_id, france):
    text = france.choices[0].message.content
    assert " Paris" in text
    r = client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=24, stop=[" Paris"])
    assert r.choices[0].message.content == text[: text.index(" Paris")]
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_ends_with_length(client, model_id):
    # The catalog's id names the default model too.
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE, max_tokens=2)
    assert r.model == model_id
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 2


def test_same_seed_same_text(client, model_id):
    ask = dict(model=model_id, messages=[{"role": "user", "content": "Tell me a story."}],
               temperature=1.0, top_p=0.95, seed=1234, max_tokens=8)
    a = client.chat.completions.create(**ask).choices[0].message.content
    b = client.chat.completions.create(**ask).choices[0].message.content
    assert a and a == b


ERROR_CASES = {
    # name: (body or raw bytes, status, param, code)
    "malformed-json": (b'{"model": "m", "messages": [', 400, None, None),
    "not-an-object": (b"[1, 2]", 400, None, "invalid_type"),
    "missing-model": ({"messages": FRANCE}, 400, "model", "missing_required_parameter"),
    "unknown-model": ({"model": "gpt-9", "messages": FRANCE}, 404, "model", "model_not_found"),
    "negative-temperature": ({"messages": FRANCE, "temperature": -1}, 400, "temperature", "invalid_value"),
    "top-p-over-1": ({"messages": FRANCE, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    "temperature-string": ({"messages": FRANCE, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    "zero-max-tokens": ({"messages": FRANCE, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    "empty-messages": ({"messages": []}, 400, "messages", "invalid_value"),
    "unknown-role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    "image-part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                   400, "messages[0].content", "invalid_value"),
    "two-choices": ({"messages": FRANCE, "n": 2}, 400, "n", "invalid_value"),
    "five-stops": ({"messages": FRANCE, "stop": list("abcde")}, 400, "stop", "invalid_value"),
    "too-long-for-the-context": ({"messages": [{"role": "user", "content": "word " * 3000}]},
                                 400, "messages", "context_length_exceeded"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_request_error_shape(http, model_id, case):
    body, status, param, code = ERROR_CASES[case]
    if isinstance(body, dict):
        body = {"model": model_id, **body} if case != "missing-model" else body
        r = http.post("/chat/completions", json=body)
    else:
        r = http.post("/chat/completions", content=body, headers={"Content-Type": "application/json"})
    err = _error(r, status)
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == "invalid_request_error"


def test_oversized_body_gets_413(http, model_id):
    huge = {"model": model_id, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    err = _error(http.post("/chat/completions", json=huge), 413)
    assert err["code"] == "request_too_large"


def test_unknown_route_and_method(http):
    assert "/v1/embeddings" in _error(http.post("/embeddings", json={}), 404)["message"]
    _error(http.get("/chat/completions"), 405)
    _error(http.get("/models/nope"), 404)


def test_official_client_raises_typed_errors(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=FRANCE, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=FRANCE)


def test_api_key_is_required(server, model_id):
    with httpx.Client(base_url=server.base_url, timeout=30) as anon:
        assert anon.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            err = _error(anon.get("/models", headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        err = _error(anon.post("/chat/completions", json={"model": model_id, "messages": FRANCE}), 401)
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model_id, messages=FRANCE)


def _stats(http) -> dict:
    return http.get("/attnchat/stats").json()


#: A reply that runs to max_tokens: with the default model from its Q4_1 blocks, "Count from 1 to 1000"
#: stopped after 51 tokens (1.2 s: the non-streamed client's 1.5 s timeout never fired); this one ran
#: to 400 of 400 tokens (as did "Repeat the word hello 1000 times").
LONG_ASK = [{"role": "user", "content": "Write a very long story about a dragon, at least 2000 words."}]


def _hang_up_streamed(http, model_id) -> None:
    ask = {"model": model_id, "messages": LONG_ASK, "max_tokens": 1500, "stream": True}
    with http.stream("POST", "/chat/completions", json=ask) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                return  # the first token: now hang up


def _hang_up_waiting(http, model_id) -> None:
    ask = {"model": model_id, "messages": LONG_ASK, "max_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        http.post("/chat/completions", json=ask, timeout=1.5)


@pytest.mark.parametrize("hang_up", [
    _hang_up_streamed,
    _hang_up_waiting,
], ids=["streamed", "not-streamed"])
def test_disconnect_cancels_the_generation(http, client, model_id, hang_up):
    cancelled_before = _stats(http)["finished"].get("cancelled", 0)
    hang_up(http, model_id)
    deadline = time.monotonic() + 30
    while (s := _stats(http))["finished"].get("cancelled", 0) == cancelled_before:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
    last = s["last"][0]
    assert last["finish_reason"] == "cancelled" and last["completion_tokens"] < 200
    assert last["client"] == "127.0.0.1"   # the Server panel's request log names it
    # The engine is free again: the next request is answered, not queued behind 1500 tokens.
    t0 = time.monotonic()
    r = client.chat.completions.create(model=model_id, messages=FRANCE, max_tokens=3)
    assert r.choices[0].message.content and time.monotonic() - t0 < 60
    assert not _stats(http)["busy"]


def test_concurrent_requests_are_queued_and_all_answered(client, model_id):
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        r = client.chat.completions.create(model=model_id, max_tokens=4,
                                           messages=[{"role": "user", "content": f"Say the number {i}."}])
        answers[i] = r.choices[0].finish_reason

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(answers) == [0, 1, 2] and set(answers.values()) <= {"stop", "length"}


def test_the_default_server_batches_and_says_why(server, client, model_id, http):
    """No --parallel: four replies decode together, as the startup line says."""
    line = next(x for x in server.output if "decode together" in x)
    assert line.startswith("attnchat: 4 replies decode together (continuous batching over a 256 MiB paged KV cache")
    before = _stats(http)
    assert before["parallel"] == 4
    done: list[str] = []

    def ask(i: int) -> None:
        r = client.chat.completions.create(model=model_id, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": f"Tell me about the number {i}."}])
        done.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = _stats(http)
    assert len(done) == 4
    # one at a time, each decoded row would take a step of its own (and each prompt one more)
    assert after["decoded_rows"] - before["decoded_rows"] > after["decode_steps"] - before["decode_steps"]


def test_a_setting_batching_cannot_take_runs_one_at_a_time_and_says_why(guarded_server):
    line = next(x for x in guarded_server.output if x.startswith("attnchat: one request at a time"))
    assert line == "attnchat: one request at a time: batching needs --overflow stop, not --overflow truncate-middle\n"
    assert "parallel" not in httpx.get(guarded_server.base_url + "/attnchat/stats").json()
