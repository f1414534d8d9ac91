"""``logprobs`` / ``top_logprobs`` and ``frequency_penalty`` / ``presence_penalty`` through
the official ``openai`` client."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_logprobs_of_a_greedy_reply(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token


def test_streamed_logprobs_cover_every_token(client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, messages=FRANCE, temperature=0, max_tokens=8,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    assert "".join(t.token for t in tokens) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_penalties_change_a_repetitive_reply(client, model_id):
    ask = dict(model=model_id, temperature=0, max_tokens=16,
               # a reply that repeats at any kernel choice and KV-cache dtype ("Write the word cat ten
               # times." answered "Catten ten times." with the float16 cache: nothing to penalize)
               messages=[{"role": "user", "content": "Write cat cat cat cat cat cat cat cat cat cat."}])
    plain = client.chat.completions.create(**ask).choices[0].message.content
    penalized = client.chat.completions.create(**ask, frequency_penalty=2.0, presence_penalty=2.0)
    text = penalized.choices[0].message.content
    assert text != plain
    assert text.lower().count("cat") < plain.lower().count("cat"), (plain, text)


def test_penalty_out_of_range_is_a_400(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=FRANCE, max_tokens=2, presence_penalty=3)
    assert e.value.param == "presence_penalty"
