"""Tool calls through the official ``openai`` client: a forced call that parses and
validates, streamed as ``tool_calls`` deltas, a tool result fed back, a plain schema
(objects left open, as in OpenAI's examples) that ends, a call cut by ``max_tokens``,
bad tools refused."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def called(client, model_id):
    return client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER], tool_choice="required",
                                          max_tokens=60)


def test_required_call_parses_and_validates(called):
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_named_call_is_streamed_as_a_tool_calls_delta(client, model_id):
    chunks = list(client.chat.completions.create(
        model=model_id, messages=ASK, tools=[WEATHER], max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].index == 0
    json.loads(deltas[0].function.arguments)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_result_is_read_back(client, model_id, called):
    call = called.choices[0].message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees celsius."}]
    r = client.chat.completions.create(model=model_id, messages=follow, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    assert r.choices[0].message.tool_calls is None


def test_auto_answers_in_text_or_one_valid_call(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi, who are you?"}],
                                       tools=[WEATHER], max_tokens=24)
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                            WEATHER["function"]["parameters"])
    else:
        assert choice.message.content and not choice.message.content.startswith("<")


#: OpenAI's example: a plain object schema, ``additionalProperties`` unset.
PLAIN = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def _plain(client, model_id, **kw):
    return client.chat.completions.create(model=model_id, messages=PARIS, tools=[PLAIN], tool_choice="required",
                                          temperature=0, **kw)


@pytest.fixture(scope="module")
def plain(client, model_id):
    """The reported request (greedy): the model once wrote '"city":"Paris","type":"object",
    "properties":{..."value":15.000000…' until max_tokens (150 tokens, 74 s)."""
    return _plain(client, model_id, max_tokens=150, logprobs=True)


def test_a_plain_schema_is_closed_and_the_call_ends(plain):
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert plain.usage.completion_tokens < 40


def test_a_call_cut_by_max_tokens_comes_back_as_a_partial_call(client, model_id, plain):
    """As OpenAI: finish_reason 'length' and the arguments written so far, never the raw text."""
    pieces = [t.token for t in plain.choices[0].logprobs.content]  # the call as the model wrote it
    text = "".join(pieces)
    start = text.index('"arguments":') + len('"arguments":')
    n = next(i for i in range(len(pieces)) if len("".join(pieces[:i])) > start + 3)  # a few characters in
    partial = "".join(pieces[:n])[start:]
    with pytest.raises(ValueError):
        json.loads(partial)
    cut = _plain(client, model_id, max_tokens=n).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    assert [(c.function.name, c.function.arguments) for c in cut.message.tool_calls] == [("get_weather", partial)]
    chunks = list(_plain(client, model_id, max_tokens=n, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", partial)]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    # Cut before the name is whole: no call, empty content (not '<tool_call>{"na').
    early = _plain(client, model_id, max_tokens=2).choices[0]
    assert (early.finish_reason, early.message.content, early.message.tool_calls) == ("length", "", None)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_a_400(client, model_id, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=ASK, max_tokens=4, **extra)
    assert e.value.param == param
