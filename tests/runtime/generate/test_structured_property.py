"""Structured output always ends: over random schemas, seeds and token
limits, a sampled reply of the default model under the schema's grammar parses, validates
against the client's schema and ends (the model's end of turn) before ``max_tokens``.

A few examples only (each is a real reply, ~5-20 s on two shared cores); the fixed
langchain-like schema runs every time."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.generate.chat_format import Message
from runtime.generate.constrained import compiler_for
from runtime.generate.events import GenerationSettings
from runtime.generate.json_bounds import CAP_STEPS, for_generation, max_tokens
from runtime.generate.sampling import SamplingParams
from runtime.generate.session import ChatSession

pytestmark = pytest.mark.slow

KEYS = st.sampled_from(["name", "kind", "count", "items", "price", "tags", "city", "ok", "notes", "id"])
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.integers(1, 40).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "integer"}),
    st.integers(0, 1000).map(lambda n: {"type": "integer", "minimum": 0, "maximum": n}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "green", "blue", "fruit", "vegetable", "yes"]), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
)


def _object(children):
    return st.dictionaries(KEYS, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req}))


SCHEMAS = _object(st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda s: {"type": "array", "items": s}, inner), _object(inner)), max_leaves=6))

BASKET = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
    "type": "object", "required": ["name", "kind", "count"], "properties": {
        "name": {"type": "string"}, "kind": {"enum": ["fruit", "vegetable"]}, "count": {"type": "integer"}}}}}}


def _reply(model, schema: dict, seed: int, limit: int):
    grammar = compiler_for(model).json_schema(schema, budget=limit - 1)
    s = ChatSession(model, system_prompt="Answer with JSON only.", settings=GenerationSettings(
        max_new_tokens=limit, sampling=SamplingParams(temperature=1.0, seed=seed),
        logits_processors=(grammar.processor(),)))
    finish = s.run(s.send("List a few things from a market, with counts."))
    return grammar, finish


def _check(schema, grammar, finish, limit):
    assert finish.reason == "stop", (finish.reason, finish.text)
    assert finish.stats.completion_tokens < limit
    assert finish.stats.completion_tokens <= grammar.max_tokens
    jsonschema.validate(json.loads(finish.text), schema)


@pytest.mark.parametrize("seed", [0])
def test_the_langchain_basket_ends(default_model, seed):
    """A langchain-like schema (a nested array of objects with an enum and a required integer)
    at 200 tokens: the array closes and the reply ends, no item repeated to the limit."""
    grammar, finish = _reply(default_model, BASKET, seed, 200)
    _check(BASKET, grammar, finish, 200)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), limit=st.sampled_from([80, 120, 160]))
def test_every_reply_parses_validates_and_ends(default_model, schema, seed, limit):
    # a schema whose smallest reply cannot fit the limit is not one this can promise
    smallest = max_tokens(for_generation(schema, caps=CAP_STEPS[-1])[0])
    if smallest >= limit:
        return
    grammar, finish = _reply(default_model, schema, seed, limit)
    _check(schema, grammar, finish, limit)
