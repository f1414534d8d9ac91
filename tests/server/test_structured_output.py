"""``response_format`` through the official ``openai`` client: JSON mode, a JSON schema,
``chat.completions.parse`` into a pydantic model, a plain schema closed, and schemas the
server refuses."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"enum": ["France", "Spain", "Italy"]}},
        "required": ["city", "country"], "additionalProperties": False}


ASK = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]


def test_json_schema_reply_validates(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=ASK, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, CITY)
    assert value["country"] == "France"


def test_json_object_mode_streams_an_object(client, model_id):
    chunks = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=40, stream=True,
                                            response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("strict", [None, False])
def test_a_plain_schema_is_closed_even_when_strict_is_false(client, model_id, strict):
    """Unset additionalProperties: left open, the default model adds "wind", "temperature_humid",
    ... until max_tokens (100 tokens, 20 s) with the object unclosed; closed, it stops. langchain
    sends ``"strict": false`` by default: that is no wish for invented keys."""
    plain = {"type": "object", "properties": {"city": {"type": "string"}, "temperature": {"type": "number"}},
             "required": ["city", "temperature"]}
    spec = {"name": "w", "schema": plain, **({} if strict is None else {"strict": strict})}
    r = client.chat.completions.create(
        model=model_id, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": spec})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"city", "temperature"}


class City(BaseModel):
    city: str
    country: str


def test_parse_into_a_pydantic_model(client, model_id):
    r = client.chat.completions.parse(model=model_id, messages=ASK, max_tokens=40, response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.city


@pytest.mark.parametrize("fmt", [
    {"type": "xml"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}},
    {"type": "json_schema", "json_schema": "nope"},
    # No finite value: the grammar could never end (a 200 with '{"a":' before).
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}, "required": ["a"]},
                  "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}}},
])
def test_bad_response_format_is_a_400(client, model_id, fmt):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=ASK, max_tokens=4, response_format=fmt)
    assert e.value.param == "response_format" and e.value.code == "invalid_value"
