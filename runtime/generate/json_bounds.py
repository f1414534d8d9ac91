"""The JSON schema a reply is generated under: the client's schema, closed and bounded, so
a small model cannot write forever inside a value that stays valid.

Two ways a schema let the default model run to its token limit (both seen with the
``openai`` client and a plain ``get_weather(city)`` tool, 74 s then ``finish_reason``
``length``):

- **Open objects**: an object schema that leaves ``additionalProperties`` unset allows
  any further key (JSON Schema's default), and the model went on inventing them.
  :func:`for_generation` closes it (``additionalProperties: false``) as OpenAI's strict
  mode requires, recursively; an explicit ``true`` or a schema is kept. ``close=False``
  keeps every object as the client wrote it.
- **Endless numbers**: JSON numbers have no length limit (``15.000000000…``). Every
  ``number`` gets at most :data:`FRACTION_DIGITS` digits after the point
  (``multipleOf: 1e-6``, which llguidance compiles to a digit bound), every ``number``
  and ``integer`` at most 15 digits before it (``minimum``/``maximum`` ±(10^15 - 1)),
  unless the schema gives its own bound. llguidance has no option for this (its JSON
  options are separators, whitespace, ``coerce_one_of``, ``lenient`` and escapes), so it is
  a schema rewrite. No exponent is written under such a bound (llguidance's number form).
  Values the schema left open (``{}``, ``additionalProperties: true``, untyped ``items``,
  ``json_object``) become :data:`ANY`: any JSON value with numbers so bounded.

The rewrite only narrows: every value valid under the result is valid under the client's
schema. Left as given (rewriting them could widen what is allowed, or make it
unsatisfiable): ``not``, ``if``; the object level of an ``allOf`` piece, a ``then``/``else``,
a dependent schema, an ``anyOf``/``oneOf`` branch beside ``properties`` of its own, and of an
object that may take properties from ``allOf``/``anyOf``/``oneOf``/``$ref`` beside its own.
Pure data; no torch, no Qt.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ANY", "ANY_NAME", "FRACTION_DIGITS", "INTEGER_DIGITS", "for_generation", "with_any"]

#: Digits after the decimal point a generated number may have (6: 0.1 m in degrees of latitude).
FRACTION_DIGITS = 6
#: Digits before it (JSON readers keep integers exact up to 2^53, about 9.0e15).
INTEGER_DIGITS = 15
_BIG = 10 ** INTEGER_DIGITS - 1
ANY_NAME = "attnchat_any"
_ANY_REF = {"$ref": f"#/$defs/{ANY_NAME}"}
_NUMBER = {"type": "number", "multipleOf": 10.0 ** -FRACTION_DIGITS, "minimum": -_BIG, "maximum": _BIG}
#: Any JSON value, numbers bounded as above, objects open (their values :data:`ANY` too).
ANY: dict[str, Any] = {"anyOf": [
    {"type": "string"}, _NUMBER, {"type": "boolean"}, {"type": "null"},
    {"type": "array", "items": _ANY_REF}, {"type": "object", "additionalProperties": _ANY_REF}]}

#: Keywords that do not constrain a value: a schema holding only these allows anything.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$id"})
#: Subschemas of other values (a property's, an item's): closed at their own level.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("additionalItems", "contains", "propertyNames", "unevaluatedItems")
_MIXERS = ("allOf", "anyOf", "oneOf", "$ref")


def for_generation(schema: Any, *, close: bool = True, ref_base: str = "") -> tuple[Any, bool]:
    """(``schema`` closed and bounded as the module says, whether it refers to :data:`ANY`).

    Args:
        schema: a JSON schema (a dict, or a boolean); not changed.
        close: give objects that leave ``additionalProperties`` unset ``false``.
        ref_base: the JSON pointer where ``schema`` will sit inside the schema handed to
            the engine (``"/anyOf/0/properties/arguments"``): its own ``#...`` references
            are moved there. ``""``: it is the root.

    The caller puts :data:`ANY` under ``$defs`` at the root when the flag is True
    (:func:`with_any`).
    """
    walker = _Walker(close, ref_base)
    return walker.walk(schema, close_here=True), walker.used_any


def with_any(root: dict[str, Any]) -> dict[str, Any]:
    """``root`` with :data:`ANY` added to its ``$defs`` (a copy)."""
    return {**root, "$defs": {**(root.get("$defs") or {}), ANY_NAME: ANY}}


class _Walker:
    def __init__(self, close: bool, ref_base: str):
        self.close, self.ref_base, self.used_any = close, ref_base, False

    def any(self) -> dict[str, Any]:
        self.used_any = True
        return dict(_ANY_REF)

    def walk(self, s: Any, close_here: bool = True) -> Any:
        if s is True or (isinstance(s, dict) and not set(s) - _ANNOTATIONS):
            return self.any()
        if not isinstance(s, dict):
            return s  # False, or something the engine will refuse in its own words
        out = dict(s)
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and self.ref_base:
            out["$ref"] = "#" + self.ref_base + ref[1:]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {k: self.walk(v) for k, v in out[key].items()}
        for key in _SUBSCHEMAS:
            if key in out:
                out[key] = self.walk(out[key])
        if isinstance(out.get("prefixItems"), list):
            out["prefixItems"] = [self.walk(v) for v in out["prefixItems"]]
        # Schemas of this same value: alternatives are closed at their level unless this one
        # lists properties of its own (closing a branch would then refuse them); pieces of
        # an allOf, a then/else or a dependent schema never are (their keys are each other's).
        own = "properties" in out or "patternProperties" in out
        for key in ("anyOf", "oneOf"):
            if isinstance(out.get(key), list):
                out[key] = [self.walk(v, close_here=not own) for v in out[key]]
        if isinstance(out.get("allOf"), list):
            out["allOf"] = [self.walk(v, close_here=False) for v in out["allOf"]]
        for key in ("then", "else"):
            if key in out:
                out[key] = self.walk(out[key], close_here=False)
        if isinstance(out.get("dependentSchemas"), dict):
            out["dependentSchemas"] = {k: self.walk(v, close_here=False) for k, v in out["dependentSchemas"].items()}
        types = _types(out)
        if "array" in types or "items" in out:
            items = out.get("items")
            out["items"] = [self.walk(v) for v in items] if isinstance(items, list) else \
                self.walk(True if items is None else items)
        if "object" in types or "properties" in out:
            self._object(out, close_here)
        if types & {"number", "integer"}:
            _bound_number(out, "number" in types)
        return out

    def _object(self, out: dict[str, Any], close_here: bool) -> None:
        extra = out.get("additionalProperties")
        if extra is None:
            mixed = any(k in out for k in _MIXERS) or "unevaluatedProperties" in out
            out["additionalProperties"] = False if (self.close and close_here and not mixed) else self.any()
        else:
            out["additionalProperties"] = self.walk(extra)


def _types(s: dict[str, Any]) -> set[str]:
    t = s.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _bound_number(out: dict[str, Any], fractional: bool) -> None:
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -_BIG
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = _BIG
    if fractional and "multipleOf" not in out:
        out["multipleOf"] = 10.0 ** -FRACTION_DIGITS
