"""runtime.generate.json_finite: a schema whose every value is infinite (a ``$ref`` cycle
with no way out) is refused before a grammar is built from it; one with a way out is not."""
from __future__ import annotations

import pytest

from runtime.generate.json_finite import NoFiniteValue, check_finite

OBJ = {"type": "object"}


def defs(**d):
    return {"$defs": d}


ENDLESS = [
    {"$ref": "#"},
    {**defs(A={**OBJ, "properties": {"a": {"$ref": "#/$defs/B"}}, "required": ["a"]}, B={"$ref": "#/$defs/A"}),
     "$ref": "#/$defs/A"},
    {**OBJ, "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#"}], **defs(A={"allOf": [{"$ref": "#"}]})},
    {**OBJ, "properties": {"x": {"$ref": "#/definitions/N"}}, "required": ["x"],
     "definitions": {"N": {**OBJ, "properties": {"next": {"$ref": "#/definitions/N"}}, "required": ["next"]}}},
    {**OBJ, "required": ["missing"], "additionalProperties": False},
    {"enum": []},
    False,
]

FINITE = [
    {},
    True,
    {"$ref": "#/$defs/A", **defs(A={"type": "string"})},
    # A linked list: "next" may be left out.
    {**OBJ, "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["value"]},
    # A tree: children may be an empty array.
    {**OBJ, "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["children"]},
    # A cycle with a null branch.
    {**defs(A={"anyOf": [{"type": "null"}, {"$ref": "#/$defs/B"}]}, B={**OBJ, "properties": {"a": {"$ref": "#/$defs/A"}},
                                                                        "required": ["a"]}), "$ref": "#/$defs/B"},
    # An unreachable cyclic definition is harmless.
    {**defs(Loop={"$ref": "#/$defs/Loop"}), "type": "string"},
    # A reference this module cannot resolve: the engine names it.
    {"$ref": "#/nowhere"},
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_no_finite_value_is_refused_in_one_line(schema):
    with pytest.raises(NoFiniteValue) as info:
        check_finite(schema)
    text = str(info.value)
    assert "\n" not in text and text.startswith("the JSON schema has no finite value")


def test_the_message_names_the_reference():
    with pytest.raises(NoFiniteValue, match=r"'\$ref' '#' refers back to itself"):
        check_finite({"$ref": "#"})


@pytest.mark.parametrize("schema", FINITE)
def test_a_way_out_is_enough(schema):
    check_finite(schema)


def test_a_long_chain_resolves_in_passes():
    """A chain of 200 definitions ending in a string: each pass of the fixed point settles one more."""
    chain = {f"D{i}": {**OBJ, "properties": {"n": {"$ref": f"#/$defs/D{i + 1}"}}, "required": ["n"]} for i in range(200)}
    chain["D200"] = {"type": "string"}
    check_finite({"$defs": chain, "$ref": "#/$defs/D0"})
    chain["D200"] = {"$ref": "#/$defs/D0"}
    with pytest.raises(NoFiniteValue):
        check_finite({"$defs": chain, "$ref": "#/$defs/D0"})


def test_the_grammar_compiler_refuses_it(monkeypatch):
    """Through GrammarCompiler.json_schema, before the engine sees it (no tokenizer needed)."""
    from runtime.generate import constrained

    c = constrained.GrammarCompiler.__new__(constrained.GrammarCompiler)
    with pytest.raises(constrained.GrammarError, match="no finite value"):
        c.json_schema({"$ref": "#"})


def test_a_tool_with_an_endless_schema_is_refused():
    from attnchat.server.tools import ToolError, parse_tools

    tools = [{"type": "function", "function": {"name": "f", "parameters": {**OBJ, "properties": {"a": {"$ref": "#"}},
                                                                          "required": ["a"]}}}]
    with pytest.raises(ToolError) as info:
        parse_tools(tools, None)
    assert "no finite value" in str(info.value)
