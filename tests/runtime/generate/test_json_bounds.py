"""The schema a reply is generated under (runtime.generate.json_bounds): objects closed where the
client left ``additionalProperties`` unset, numbers bounded in digits. The rewrite itself
on plain data; what the compiled grammar then allows on a tiny tokenizer (no model)."""
from __future__ import annotations

import pytest

from attnchat.server import tools
from runtime.generate.constrained import GrammarCompiler, schema_of
from runtime.generate.json_bounds import ANY_NAME, CAP_STEPS, DEFAULT_CAPS, fit, for_generation, max_tokens

REF_ANY = {"$ref": f"#/$defs/{ANY_NAME}"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_objects_are_closed_recursively_and_explicit_choices_kept():
    schema = {"type": "object", "properties": {
        "where": CITY, "extra": {"type": "object", "additionalProperties": True},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "boolean"}}}}}}
    out, uses_any = for_generation(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["extra"]["additionalProperties"] == REF_ANY  # explicit true: still open
    assert out["properties"]["tags"]["additionalProperties"] == {"type": "string", "maxLength": 256}
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert uses_any and "additionalProperties" not in schema  # the client's schema is not changed


def test_close_false_and_mixed_levels_stay_open():
    assert for_generation(CITY, close=False)[0]["additionalProperties"] == REF_ANY
    # allOf pieces name each other's keys: closing one would refuse the other's.
    merged = {"allOf": [CITY, {"type": "object", "properties": {"unit": {"type": "string"}}}]}
    assert all(p["additionalProperties"] == REF_ANY for p in for_generation(merged)[0]["allOf"])
    # Properties of its own beside anyOf branches: neither level is closed.
    mixed = {"type": "object", "properties": {"a": {"type": "string"}},
             "anyOf": [{"properties": {"b": {"type": "string"}}}]}
    out = for_generation(mixed)[0]
    assert out["additionalProperties"] == REF_ANY and out["anyOf"][0]["additionalProperties"] == REF_ANY
    # Whole alternatives are closed each.
    alt = for_generation({"anyOf": [CITY, {"type": "null"}]})[0]
    assert alt["anyOf"][0]["additionalProperties"] is False and alt["anyOf"][1] == {"type": "null"}


def test_numbers_get_digit_bounds_unless_the_schema_has_its_own():
    out = for_generation({"type": "object", "properties": {
        "t": {"type": "number"}, "n": {"type": "integer"}, "p": {"type": "number", "minimum": 0, "multipleOf": 0.5},
        "maybe": {"type": ["number", "null"]}}})[0]["properties"]
    assert out["t"] == {"type": "number", "minimum": -(10 ** 15 - 1), "maximum": 10 ** 15 - 1, "multipleOf": 1e-6}
    assert out["n"] == {"type": "integer", "minimum": -(10 ** 15 - 1), "maximum": 10 ** 15 - 1}
    assert out["p"] == {"type": "number", "minimum": 0, "maximum": 10 ** 15 - 1, "multipleOf": 0.5}
    assert out["maybe"]["multipleOf"] == 1e-6


def test_references_move_with_the_schema():
    params = {"$defs": {"P": CITY}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}
    out = for_generation(params, ref_base="/anyOf/0/properties/arguments")[0]
    assert out["properties"]["p"] == {"$ref": "#/anyOf/0/properties/arguments/$defs/P"}
    assert out["$defs"]["P"]["additionalProperties"] is False


def test_strict_false_does_not_open_objects(compiler):
    """langchain sends ``"strict": false`` by default: a default, not a wish for invented keys
    (read as one, 3 of 5 seeds ran to max_tokens adding keys). Only the schema opens an object."""
    for strict in (True, False, None):
        fmt = {"type": "json_schema", "json_schema": {"schema": CITY, **({} if strict is None else {"strict": strict})}}
        grammar = compiler.json_schema(schema_of(fmt))
        assert grammar.matches('{"city":"Paris"}') and not grammar.matches('{"city":"Paris","x":1}')
    opened = compiler.json_schema({**CITY, "additionalProperties": True})
    assert opened.matches('{"city":"Paris","x":1}')


def test_arrays_and_strings_get_documented_caps():
    s = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                          "few": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                                          "many": {"type": "array", "minItems": 40, "items": {"type": "boolean"}},
                                          "word": {"type": "string", "maxLength": 5}, "kind": {"enum": ["a", "b"]}}}
    out = for_generation(s)[0]["properties"]
    assert out["tags"]["maxItems"] == DEFAULT_CAPS.items == 16
    assert out["tags"]["items"]["maxLength"] == DEFAULT_CAPS.length == 256
    assert out["few"]["maxItems"] == 3 and out["many"]["maxItems"] == 40  # the schema's own bounds stay
    assert out["word"] == {"type": "string", "maxLength": 5} and out["kind"] == {"enum": ["a", "b"]}


def test_the_longest_reply_is_counted_and_caps_shrink_to_fit():
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                             "kind": {"enum": ["fruit", "vegetable"]},
                                             "n": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["name", "kind", "n"], "additionalProperties": False}
    # {"name":"0123456789","kind":"vegetable","n":999}: 2 + (7+12+1) + (7+11+1) + (4+3+0) = 48 (one separator less)
    assert max_tokens(item) == 2 + (7 + 12 + 1) + (7 + 11 + 1) + (4 + 3 + 1)
    basket = {"type": "object", "properties": {"items": {"type": "array", "items": item}}, "required": ["items"]}
    for budget in (1000, 199, 80):
        root, caps, size = fit(basket, budget)
        assert size <= budget and caps in CAP_STEPS
        assert root["properties"]["items"]["maxItems"] == caps.items
        i = CAP_STEPS.index(caps)  # the first that fits: the one before it does not
        assert i == 0 or max_tokens(for_generation(basket, caps=CAP_STEPS[i - 1])[0]) > budget
    assert fit(basket, None)[1] == DEFAULT_CAPS
    # json_object: depth and size bound
    root, caps, size = fit(None, 500)
    assert size <= 500 and root["maxProperties"] == caps.open_items and root["additionalProperties"] is False


@pytest.fixture(scope="module")
def compiler():
    from tests.runtime.tiny_models import make_tokenizer

    tok = make_tokenizer()
    return GrammarCompiler(tok, [tok.eos_token_id])


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


def _call(args: str, name: str = "get_weather") -> str:
    return tools.OPEN + '{"name":"' + name + '","arguments":' + args + "}" + tools.CLOSE


def test_a_plain_tool_schema_allows_no_invented_keys(compiler):
    """The reported reply: the default model added "type", "properties", ... to {"city": ...}."""
    grammar = compiler.lark(tools.grammar_source(*tools.parse_tools([WEATHER], "required")))
    assert grammar.matches(_call('{"city":"Paris"}'))
    assert not grammar.matches(_call('{"city":"Paris","type":"object"}'))
    loose = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    assert not compiler.lark(tools.grammar_source(*tools.parse_tools([loose], "required"))).matches(
        _call('{"city":"Paris","type":"object"}'))  # strict false: still closed


def test_pydantic_style_defs_in_tool_parameters_compile(compiler):
    """openai.pydantic_function_tool puts nested models under $defs: refs are rebased."""
    params = {"$defs": {"Place": CITY}, "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}},
              "required": ["place"]}
    fn = {"type": "function", "function": {"name": "find", "parameters": params}}
    grammar = compiler.lark(tools.grammar_source(*tools.parse_tools([WEATHER, fn], "required")))
    assert grammar.matches(_call('{"place":{"city":"Paris"}}', "find"))
    assert not grammar.matches(_call('{"place":{"city":"Paris","x":1}}', "find"))


@pytest.mark.parametrize("text, ok", [
    ('{"t":15.5}', True), ('{"t":-0.000001}', True), ('{"t":15.000000}', True), ('{"t":15.0000000}', False),
    ('{"t":999999999999999}', True), ('{"t":1000000000000000}', False), ('{"t":1e5}', False),
    ('{"t":1,"x":2}', False),
])
def test_numbers_end_within_their_digits(compiler, text, ok):
    assert compiler.json_schema({"type": "object", "properties": {"t": {"type": "number"}}}).matches(text) is ok


def test_json_mode_stays_open_with_bounded_numbers_depth_and_size(compiler):
    grammar = compiler.json_schema(None)
    assert grammar.matches('{"a":[1,{"b":null}],"c":2.5}')
    assert not grammar.matches('{"a":2.0000001}')
    assert not grammar.matches('{"a":{"b":{"c":{"d":1}}}}')  # deeper than the caps' three levels
    assert not grammar.matches("{" + ",".join(f'"k{i}":1' for i in range(9)) + "}")  # 9 keys
    small = compiler.json_schema(None, budget=60)
    assert small.max_tokens <= 60 and not small.matches('{"a":{"b":1}}')
