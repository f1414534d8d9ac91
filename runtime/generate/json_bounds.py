"""The JSON schema a reply is generated under: the client's schema, closed and bounded, so
a small model cannot write forever inside a value that stays valid, and a reply fits the
tokens it may take.

Ways a schema let the default model run to its token limit (seen with the ``openai``
client, langchain-openai and a plain ``get_weather(city)`` tool):

- **Open objects**: an object schema that leaves ``additionalProperties`` unset allows
  any further key (JSON Schema's default), and the model went on inventing them.
  :func:`for_generation` closes it (``additionalProperties: false``), recursively, whatever
  the request's ``strict`` says: langchain's ``strict: false`` is a default, not a wish
  for invented keys (the default model adds them until ``max_tokens``). An explicit ``true``
  or a schema is kept (then only the values are bounded, not how many keys come:
  llguidance bounds ``maxProperties`` only where every listed property is required).
- **Endless arrays and strings**: an array without ``maxItems`` repeated the same item
  until ``max_tokens``. Arrays get at most :attr:`Caps.items` items and strings at most
  :attr:`Caps.length` characters unless the schema bounds them itself.
- **Endless numbers**: JSON numbers have no length limit (``15.000000000…``). Every
  ``number`` gets at most :data:`FRACTION_DIGITS` digits after the point
  (``multipleOf: 1e-6``, which llguidance compiles to a digit bound), every ``number``
  and ``integer`` at most 15 digits before it (``minimum``/``maximum`` ±(10^15 - 1)),
  unless the schema gives its own bound. No exponent is written under such a bound.
- **Endless nesting**: values the schema left open (``{}``, ``additionalProperties: true``,
  untyped ``items``, ``json_object``) become :data:`ANY`: any JSON value at most
  :attr:`Caps.open_depth` levels deep, with at most :attr:`Caps.open_items` items or keys
  per level, keys of at most :data:`OPEN_KEY_LENGTH` characters and strings of at most
  :attr:`Caps.open_length`.

:func:`fit` then picks the largest caps of :data:`CAP_STEPS` under which the longest reply
the schema allows (:func:`max_tokens`, counting a free string's characters one token each
and a key or an enum value at its UTF-8 bytes, which no tokenization exceeds) fits the
tokens the reply may take: the default caps are :data:`DEFAULT_CAPS`, and a request with a
small ``max_tokens`` gets smaller ones. A character can take more than one token (an
escape such as ``\\n``, a character outside the tokenizer's vocabulary: up to 4 byte
tokens), so text full of those can still reach the limit; :data:`ESCAPES` leaves out
``\\u`` escapes (6 characters each).

The rewrite only narrows: every value valid under the result is valid under the client's
schema. Left as given (rewriting them could widen what is allowed, or make it
unsatisfiable): ``not``, ``if``; the object level of an ``allOf`` piece, a ``then``/``else``,
a dependent schema, an ``anyOf``/``oneOf`` branch beside ``properties`` of its own, and of an
object that may take properties from ``allOf``/``anyOf``/``oneOf``/``$ref`` beside its own.
Pure data; no torch, no Qt.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ANY", "ANY_NAME", "CAP_STEPS", "Caps", "DEFAULT_CAPS", "ESCAPES", "FRACTION_DIGITS",
           "INTEGER_DIGITS", "any_defs", "fit", "for_generation", "max_tokens", "open_object", "with_any"]

#: Digits after the decimal point a generated number may have (6: 0.1 m in degrees of latitude).
FRACTION_DIGITS = 6
#: Digits before it (JSON readers keep integers exact up to 2^53, about 9.0e15).
INTEGER_DIGITS = 15
_BIG = 10 ** INTEGER_DIGITS - 1
#: The escapes a generated string may use (llguidance's ``json_allowed_escapes``): not ``\\u``.
ESCAPES = '"\\bfnrt'
#: Characters of a key in an open object (fewer under small caps: :func:`key_length`).
OPEN_KEY_LENGTH = 32


@dataclass(frozen=True)
class Caps:
    """Bounds for what a schema leaves unbounded.

    Attributes:
        items: items of an array without ``maxItems``.
        length: characters of a string without ``maxLength`` (nor an enum or const).
        open_depth: levels of an open value (1: scalars only).
        open_items: items of an open array, keys of an open object.
        open_length: characters of an open value's string.
    """

    items: int = 16
    length: int = 256
    open_depth: int = 3
    open_items: int = 8
    open_length: int = 64


#: The caps a schema gets when its longest reply fits the tokens at hand.
DEFAULT_CAPS = Caps()
#: Tried in order by :func:`fit` until the longest reply fits; the last is used regardless.
CAP_STEPS = (DEFAULT_CAPS, Caps(16, 128, 3, 4, 32), Caps(8, 64, 3, 3, 16), Caps(8, 64, 2, 4, 16),
             Caps(8, 32, 2, 3, 8), Caps(4, 32, 2, 2, 8), Caps(4, 16, 1, 3, 8), Caps(2, 16, 1, 2, 8),
             Caps(2, 8, 1, 2, 4), Caps(1, 8, 1, 1, 4), Caps(1, 4, 1, 1, 2), Caps(1, 1, 1, 1, 1))

ANY_NAME = "attnchat_any"
_NUMBER = {"type": "number", "multipleOf": 10.0 ** -FRACTION_DIGITS, "minimum": -_BIG, "maximum": _BIG}


def _any_name(level: int) -> str:
    return ANY_NAME if level == 1 else f"{ANY_NAME}_{level}"


def _any_ref(level: int) -> dict[str, str]:
    return {"$ref": f"#/$defs/{_any_name(level)}"}


def key_length(caps: Caps) -> int:
    """Characters of a key in an open object under ``caps``: :data:`OPEN_KEY_LENGTH`, or twice
    an open string's length when that is less (at least 4)."""
    return max(4, min(OPEN_KEY_LENGTH, 2 * caps.open_length))


def open_object(level: int, caps: Caps = DEFAULT_CAPS) -> dict[str, Any]:
    """An open object whose values are level ``level + 1`` of :data:`ANY` (``json_object``'s
    root is level 0): up to ``caps.open_items`` keys of up to :func:`key_length` characters."""
    return {"type": "object", "patternProperties": {f"^.{{1,{key_length(caps)}}}$": _any_ref(level + 1)},
            "additionalProperties": False, "maxProperties": caps.open_items}


def any_defs(caps: Caps = DEFAULT_CAPS) -> dict[str, Any]:
    """The ``$defs`` of :data:`ANY` under ``caps``: one per level, the last scalars only."""
    defs = {}
    for level in range(1, caps.open_depth + 1):
        branches: list[Any] = [{"type": "string", "maxLength": caps.open_length}, _NUMBER, {"type": "boolean"},
                               {"type": "null"}]
        if level < caps.open_depth:
            branches += [{"type": "array", "items": _any_ref(level + 1), "maxItems": caps.open_items},
                         open_object(level, caps)]
        defs[_any_name(level)] = {"anyOf": branches}
    return defs


#: Any JSON value under the default caps (level 1 of :func:`any_defs`).
ANY: dict[str, Any] = any_defs()[ANY_NAME]

#: Keywords that do not constrain a value: a schema holding only these allows anything.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$schema", "$id"})
#: Subschemas of other values (a property's, an item's): closed at their own level.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("additionalItems", "contains", "propertyNames", "unevaluatedItems")
_MIXERS = ("allOf", "anyOf", "oneOf", "$ref")


def for_generation(schema: Any, *, close: bool = True, ref_base: str = "",
                   caps: Caps = DEFAULT_CAPS) -> tuple[Any, bool]:
    """(``schema`` closed and bounded as the module says, whether it refers to :data:`ANY`).

    Args:
        schema: a JSON schema (a dict, or a boolean); not changed.
        close: give objects that leave ``additionalProperties`` unset ``false``.
        ref_base: the JSON pointer where ``schema`` will sit inside the schema handed to
            the engine (``"/anyOf/0/properties/arguments"``): its own ``#...`` references
            are moved there. ``""``: it is the root.
        caps: the bounds for arrays, strings and open values.

    The caller puts :data:`ANY`'s levels under ``$defs`` at the root when the flag is True
    (:func:`with_any`).
    """
    walker = _Walker(close, ref_base, caps)
    return walker.walk(schema, close_here=True), walker.used_any


def with_any(root: dict[str, Any], caps: Caps = DEFAULT_CAPS) -> dict[str, Any]:
    """``root`` with :data:`ANY`'s levels under ``caps`` added to its ``$defs`` (a copy)."""
    return {**root, "$defs": {**(root.get("$defs") or {}), **any_defs(caps)}}


def fit(schema: dict[str, Any] | None, budget: int | None, *, close: bool = True) -> tuple[dict[str, Any], Caps, float]:
    """The schema to generate under (``$defs`` of :data:`ANY` included), its caps and the
    most tokens a reply under it takes (:func:`max_tokens`; ``inf`` where an explicitly open
    object leaves its key count free): the first caps of :data:`CAP_STEPS` under which
    that fits ``budget`` tokens (None: the defaults), else the last.

    ``schema`` None is ``json_object``: an open object whose values are :data:`ANY`.
    """
    steps = CAP_STEPS if budget is not None else (DEFAULT_CAPS,)
    for caps in steps:
        if schema is None:
            root, uses_any = open_object(0, caps), True
        else:
            root, uses_any = for_generation(schema, close=close, caps=caps)
        if uses_any:
            root = with_any(root, caps)
        size = max_tokens(root)
        if budget is None or size <= budget:
            break
    return root, caps, size


# ---- the walk -----------------------------------------------------------------------------------
class _Walker:
    def __init__(self, close: bool, ref_base: str, caps: Caps):
        self.close, self.ref_base, self.caps, self.used_any = close, ref_base, caps, False

    def any(self) -> dict[str, Any]:
        self.used_any = True
        return _any_ref(1)

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
        fixed = "enum" in out or "const" in out
        if ("array" in types or "items" in out) and not fixed:
            items = out.get("items")
            out["items"] = [self.walk(v) for v in items] if isinstance(items, list) else \
                self.walk(True if items is None else items)
            if "maxItems" not in out:
                out["maxItems"] = max(self.caps.items, _int(out.get("minItems")))
        if "string" in types and not fixed and "maxLength" not in out:
            out["maxLength"] = max(self.caps.length, _int(out.get("minLength")))
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


def _int(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _bound_number(out: dict[str, Any], fractional: bool) -> None:
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = -_BIG
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = _BIG
    if fractional and "multipleOf" not in out:
        out["multipleOf"] = 10.0 ** -FRACTION_DIGITS


# ---- the longest reply ---------------------------------------------------------------------------
def max_tokens(root: Any) -> float:
    """The most tokens compact JSON valid under ``root`` (as :func:`fit` makes it: references
    to ``#/...`` inside it) can take: a free string's characters one token each, keys, enum
    and const values their UTF-8 bytes (a token spells at least one byte), a number its
    characters. ``inf`` for what no bound limits (an untyped value, an object open to any
    number of keys, a reference cycle)."""
    return _Size(root).size(root, 0)


def _bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class _Size:
    def __init__(self, root: Any):
        self.root = root

    def resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref.lstrip("#").strip("/").split("/") if ref.strip("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit():
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return True
        return node

    def size(self, s: Any, depth: int) -> float:
        if s is False:
            return 0
        if not isinstance(s, dict) or depth > 32:
            return math.inf
        if "const" in s:
            return _bytes(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return max(_bytes(v) for v in s["enum"])
        bounds = []
        if isinstance(s.get("$ref"), str):
            bounds.append(self.size(self.resolve(s["$ref"]), depth + 1))
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                bounds.append(max(self.size(v, depth + 1) for v in s[key]))
        if isinstance(s.get("allOf"), list) and s["allOf"]:
            bounds.append(min(self.size(v, depth + 1) for v in s["allOf"]))
        types = _types(s) or ({"object"} if "properties" in s else {"array"} if "items" in s else set())
        if types:
            bounds.append(max(self.typed(s, t, depth) for t in types))
        return min(bounds) if bounds else math.inf

    def typed(self, s: dict[str, Any], t: str, depth: int) -> float:
        if t == "null":
            return 4
        if t == "boolean":
            return 5
        if t in ("integer", "number"):
            lo = s.get("minimum", s.get("exclusiveMinimum"))
            hi = s.get("maximum", s.get("exclusiveMaximum"))
            if not all(isinstance(v, (int, float)) for v in (lo, hi)):
                return math.inf
            whole = max(len(str(int(abs(v)))) for v in (lo, hi)) + (1 if lo < 0 else 0)
            step = s.get("multipleOf")
            if t == "integer" or (isinstance(step, (int, float)) and step >= 1 and float(step).is_integer()):
                return whole
            if not isinstance(step, (int, float)) or step <= 0:
                return math.inf
            return whole + 1 + max(0, math.ceil(-math.log10(step) - 1e-9))
        if t == "string":
            n = s.get("maxLength")
            return 2 + n if isinstance(n, int) else math.inf
        if t == "array":
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            n = s.get("maxItems")
            if not isinstance(n, int):
                return math.inf
            sizes = [self.size(v, depth + 1) for v in prefix[:n]]
            rest = n - len(sizes)
            if rest > 0:
                sizes.append(rest * (self.size(s.get("items", True), depth + 1) + 1))
            return 2 + sum(sizes) + len(prefix[:n])
        if t == "object":
            total = 2.0
            for key, value in (s.get("properties") or {}).items():
                total += _bytes(key) + 1 + self.size(value, depth + 1) + 1
            extra = s.get("additionalProperties", True)
            patterns = s.get("patternProperties") or {}
            if extra is False and not patterns:
                return total
            n = s.get("maxProperties")
            if not isinstance(n, int) or s.get("properties"):
                return math.inf
            values = [self.size(v, depth + 1) for v in patterns.values()]
            if extra is not False:
                values.append(self.size(extra, depth + 1))
            keys = [int(m) for p in patterns for m in re.findall(r"\{1,(\d+)\}\$$", p)]
            key = max(keys) if len(keys) == len(patterns) and patterns else math.inf
            return total + n * (2 + key + 1 + max(values) + 1)
        return math.inf
