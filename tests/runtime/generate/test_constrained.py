"""Constrained decoding (runtime.generate.constrained) and the session's logits-processor hook.

Mechanics on a tiny seeded random model (its 320-token vocabulary keeps the engine's
index cheap); truth on the real default model: for random JSON schemas (objects,
arrays, enums, numbers, nested), every reply that ends parses and validates.
"""
from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import load_model
from runtime.generate.chat_format import Message
from runtime.generate.constrained import GrammarError, compiler_for, schema_of
from runtime.generate.events import GenerationSettings
from runtime.generate.session import ChatSession


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_models import make_tiny_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"), device="cpu", dtype="float32")


def _reply(model, processors, *, max_new_tokens=40, prompt="the"):
    s = ChatSession(model, settings=GenerationSettings(max_new_tokens=max_new_tokens, logits_processors=processors))
    s.messages = [Message("user", prompt)]
    return s.run(s.reply())


def test_mask_allows_only_what_keeps_the_value_valid(tiny):
    grammar = compiler_for(tiny).json_schema({"enum": ["yes", "no"]})
    process = grammar.processor()
    logits = torch.zeros(tiny.config.vocab_size)
    out = process([], logits)
    assert out is logits  # in place: no copy of the logits per step
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    texts = {tiny.tokenizer.decode([i]) for i in allowed}
    # A JSON string opens with a quote: only tokens starting '"' (then y or n) may come first.
    assert allowed and all(t.startswith('"') for t in texts), texts
    assert all(math.isinf(x) for i, x in enumerate(logits.tolist()) if i not in allowed)


@pytest.mark.parametrize("schema, check", [
    ({"enum": ["yes", "no"]}, lambda v: v in ("yes", "no")),
    ({"type": "boolean"}, lambda v: isinstance(v, bool)),
    ({"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2}, lambda v: len(v) == 2),
])
def test_tiny_model_replies_under_a_schema(tiny, schema, check):
    """A random model left free writes random bytes; under the mask it writes the value."""
    free = _reply(tiny, (), max_new_tokens=12)
    with pytest.raises(ValueError):
        json.loads(free.text)
    finish = _reply(tiny, (compiler_for(tiny).json_schema(schema).processor(),))
    assert finish.reason == "stop", finish
    assert check(json.loads(finish.text)), finish.text


def test_bad_schemas_raise_one_line(tiny):
    c = compiler_for(tiny)
    with pytest.raises(GrammarError, match="cannot be used"):
        c.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(GrammarError, match="must be an object"):
        c.json_schema(["not", "a", "schema"])
    with pytest.raises(GrammarError, match="schema"):
        schema_of({"type": "json_schema", "json_schema": "nope"})
    assert schema_of({"type": "json_object"}) is None


def test_unconstrained_reply_is_unchanged_by_the_hook(tiny):
    """An identity processor sees every step and changes nothing: same greedy reply."""
    seen = []

    def watch(generated, logits):
        seen.append(len(generated))
        return logits

    plain, watched = _reply(tiny, ()), _reply(tiny, (watch,))
    assert watched.text == plain.text and watched.token_ids == plain.token_ids
    assert seen == list(range(len(seen))) and len(seen) >= len(plain.token_ids)


def test_prefill_continues_the_assistant_message(tiny):
    s = ChatSession(tiny, settings=GenerationSettings(max_new_tokens=5))
    s.messages = [Message("user", "the"), Message("assistant", "it is")]
    finish = s.run(s.reply())
    assert s.messages[-1] == Message("assistant", "it is" + finish.text)
    assert len(s.messages) == 2
    # The prompt ends inside the assistant's turn: no end-of-turn after "it is".
    prompt = tiny.tokenizer.decode(s.cached_token_ids)
    assert "it is<|im_end|>" not in prompt and "it is" in prompt


# ---- the property, on the real model ---------------------------------------------------
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
    st.lists(st.sampled_from(["red", "green", "blue", "cyan"]), min_size=1, max_size=3, unique=True)
      .map(lambda xs: {"enum": xs}),
)


def _object(children):
    return st.dictionaries(st.sampled_from(["name", "age", "size", "tags", "kind"]), children, min_size=1,
                           max_size=3).map(lambda props: {"type": "object", "properties": props,
                                                          "required": sorted(props), "additionalProperties": False})


_schemas = st.recursive(_leaf, lambda children: st.one_of(
    _object(children),
    st.builds(lambda items, n: {"type": "array", "items": items, "minItems": 1, "maxItems": n},
              children, st.integers(1, 3))), max_leaves=5)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas)
def test_every_constrained_reply_parses_and_validates(default_model, schema):
    grammar = compiler_for(default_model).json_schema(schema)
    finish = _reply(default_model, (grammar.processor(),), max_new_tokens=64,
                    prompt="Reply with a JSON value for this schema: " + json.dumps(schema))
    assert finish.reason == "stop", (schema, finish.text)
    jsonschema.validate(json.loads(finish.text), schema)
