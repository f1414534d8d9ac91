"""``POST /v1/completions`` through the official ``openai`` client: a prompt continued
without the chat template, streamed or not, with ``echo``, ``stop`` and ``logprobs``;
``suffix`` refused clearly."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def paris(client, model_id):
    return client.completions.create(model=model_id, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2)


def test_prompt_is_continued_as_text(paris):
    choice = paris.choices[0]
    assert paris.object == "text_completion"
    assert choice.text.lstrip().startswith("Paris"), choice.text
    assert choice.finish_reason in ("stop", "length")
    # No chat template around it: the prompt is its own tokens only (SmolLM2 adds no BOS).
    assert paris.usage.prompt_tokens == 5
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == paris.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)


def test_stream_and_echo(client, model_id, paris):
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, temperature=0, max_tokens=6,
                                            stream=True, echo=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == PROMPT + paris.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == paris.choices[0].finish_reason


def test_stop(client, model_id, paris):
    word = paris.choices[0].text.split()[0]
    r = client.completions.create(model=model_id, prompt=PROMPT, temperature=0, max_tokens=6, stop=[word])
    assert r.choices[0].text == paris.choices[0].text[: paris.choices[0].text.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_default_max_tokens_is_openais_16(client, model_id):
    r = client.completions.create(model=model_id, prompt="Once upon a time", temperature=0)
    assert r.usage.completion_tokens <= 16


@pytest.mark.parametrize("extra, param", [({"suffix": " and that is all."}, "suffix"),
                                          ({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")])
def test_refused_fields(client, model_id, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": model_id, "prompt": PROMPT, "max_tokens": 2, **extra})
    assert e.value.param == param
    if param == "suffix":
        assert "fill-in-the-middle" in e.value.message


def test_echo_with_logprobs_scores_the_prompt_too(client, model_id, paris, default_model):
    """As OpenAI's: the prompt's tokens come first, the first without a log-probability, each
    other with the model's log-probability of it after the ones before (checked against our
    model's own logits), then the reply's."""
    import torch

    r = client.completions.create(model=model_id, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2, echo=True)
    lp, reply = r.choices[0].logprobs, paris.choices[0]
    ids = default_model.encode(PROMPT)
    assert r.choices[0].text == PROMPT + reply.text
    assert "".join(lp.tokens) == PROMPT + reply.text
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[: len(ids)] == [len(default_model.decode(ids[:i])) for i in range(len(ids))]
    with torch.inference_mode():
        want = torch.log_softmax(default_model.logits(ids)[0].float(), dim=-1)
    # The server runs the file's blocks (ggml's kernels, or torch's int4 ones where ggml-python could
    # not be built), the reference float32 weights: measured without ggml-python, single tokens up to
    # 0.06 nats apart, the mean well under 0.03; with the bfloat16 prefill (widen-bf16, where the CPU
    # multiplies bfloat16) up to 0.08, the mean 0.036 (AMD EPYC Zen 4); a prompt scored one position
    # off is nats away.
    gaps = [abs(lp.token_logprobs[i] - float(want[i - 1, ids[i]])) for i in range(1, len(ids))]
    assert max(gaps) < 0.15 and sum(gaps) / len(gaps) < 0.05, gaps
    for i in range(1, len(ids)):
        assert len(lp.top_logprobs[i]) == 2 and max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i] - 1e-6
    # the reply's part is what it is without echo
    assert lp.token_logprobs[len(ids):] == pytest.approx(reply.logprobs.token_logprobs, abs=1e-4)
    # streamed: the echo chunk carries the prompt's part
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2,
                                            echo=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == lp.tokens[: len(ids)]
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-5)
