"""The edges that broke real clients: ``"stream": null``, a trailing assistant message (a
prefill), a system-only conversation, OpenAI's overflow wording, ``HEAD /health``.

Uses the shared server of ``conftest`` (the real default model: the prefill test needs
its answer to be right).
"""
from __future__ import annotations

import httpx2 as httpx
import pytest

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_null_optional_fields_are_accepted(http, model_id):
    body = {"model": model_id, "messages": FRANCE, "max_tokens": 3, "stream": None, "temperature": None,
            "top_p": None, "stop": None, "n": None, "seed": None, "logprobs": None, "tools": None,
            "response_format": None, "stream_options": None}
    r = http.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] == 3


def test_trailing_assistant_message_is_continued(client, model_id):
    prefix = "The capital of France is"
    r = client.chat.completions.create(model=model_id, temperature=0, max_tokens=4,
                                       messages=FRANCE + [{"role": "assistant", "content": prefix}])
    text = r.choices[0].message.content
    # Only the continuation comes back, and it goes on from the prefix.
    assert not text.startswith(prefix) and text.lstrip().startswith("Paris"), text
    # The prompt ends inside the assistant's turn: the prefix is prompt, not reply.
    plain = client.chat.completions.create(model=model_id, temperature=0, max_tokens=4, messages=FRANCE)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens


def test_streamed_prefill_matches(client, model_id):
    msgs = FRANCE + [{"role": "assistant", "content": "The capital of France is"}]
    whole = client.chat.completions.create(model=model_id, temperature=0, max_tokens=4, messages=msgs)
    chunks = client.chat.completions.create(model=model_id, temperature=0, max_tokens=4, messages=msgs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_system_only_conversation_is_answered(client, model_id):
    r = client.chat.completions.create(model=model_id, max_tokens=3,
                                       messages=[{"role": "system", "content": "Say hello."}])
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_overflow_uses_openais_wording(http, model_id):
    r = http.post("/chat/completions", json={"model": model_id, "messages": [{"role": "user", "content": "word " * 3000}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"].startswith("This model's maximum context length is 2048 tokens. However, your messages "
                                     "resulted in "), err["message"]


def test_long_conversation_is_refused_not_truncated(http, model_id):
    """The server's default overflow policy is stop: 40 turns that each fit but together pass
    the 2,048-token context get a 400, never a reply with the middle silently dropped."""
    turns = []
    for i in range(40):
        turns += [{"role": "user", "content": f"Tell me fact number {i} about the sea, in detail please. " * 2},
                  {"role": "assistant", "content": "The sea is deep and wide and full of life. " * 3}]
    r = http.post("/chat/completions", json={"model": model_id, "max_tokens": 4,
                                              "messages": turns + [{"role": "user", "content": "Thanks!"}]})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_head_health(server):
    r = httpx.head(server.base_url.removesuffix("/v1") + "/health", timeout=30)
    assert r.status_code == 200 and r.content == b""
