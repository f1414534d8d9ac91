"""Whether a JSON schema has a value at all: a grammar built from one without can never end.

A ``$ref`` cycle with no way out (``A`` requires a property that is ``B``, ``B`` is ``A``;
``{"$ref": "#"}``; an array of itself with ``minItems: 1``) compiles, but every value under
it is infinite: the model wrote ``{"a":`` and the reply ended there, unparsable. A schema
has a finite value when some value can be written in finitely many steps; that is the
least fixed point of the rules below over the schema's ``$ref`` targets (as a context-free
grammar's productive symbols are found), so a cycle counts only when something on it can
stop:

- ``true``, ``{}``, ``const``, a non-empty ``enum``, ``null``/``boolean``/``number``/
  ``integer``/``string``: finite. ``false``: none.
- an object: each ``required`` property's schema (an unlisted one: ``additionalProperties``,
  ``false`` when closed); properties not required may be left out.
- an array: ``minItems`` 0 is ``[]``; else each of the first ``minItems`` items'
  schemas (``prefixItems``, then ``items``).
- ``anyOf``/``oneOf``: one branch; ``allOf``: every piece; ``$ref``: its target; several
  ``type`` s: one of them; all of these together with the schema's own keys.

What the rules leave out (``not``, ``if``, patterns, bounds that contradict each other)
counts as finite: the engine refuses or allows those in its own words. A reference this
module cannot resolve counts as finite too (the engine names it). Pure data.
"""
from __future__ import annotations

from typing import Any

__all__ = ["NoFiniteValue", "check_finite"]


class NoFiniteValue(ValueError):
    """A schema no finite JSON value satisfies; ``str()`` says where, in one line."""


def check_finite(schema: Any) -> None:
    """Raise :class:`NoFiniteValue` when no finite value is valid under ``schema`` (a JSON
    schema, its ``#...`` references resolved against itself).

    Raises:
        NoFiniteValue: the message names the ``$ref`` (or the whole schema) that cannot end.
    """
    finite = _Finite(schema)
    if not finite.value(schema):
        loop = next((r for r in finite.refs if r not in finite.done), None)
        where = f"'$ref' {loop!r} refers back to itself with no way to end" if loop else "it allows no value"
        raise NoFiniteValue(f"the JSON schema has no finite value ({where}); give the cycle a way out (an "
                            "optional property, an anyOf branch without the reference, or minItems 0)")


_MISSING = object()


class _Finite:
    def __init__(self, root: Any):
        self.root = root
        self.done: set[str] = set()   # references known to have a finite value
        self.refs: list[str] = []     # every reference met, in order
        self._collect(root, 0)
        changed = True
        while changed:                # least fixed point: at most one new reference per pass
            changed = False
            for ref in self.refs:
                if ref not in self.done and self.value(self._resolve(ref)):
                    self.done.add(ref)
                    changed = True

    def _collect(self, s: Any, depth: int) -> None:
        if depth > 256:
            return
        if isinstance(s, dict):
            ref = s.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in self.refs:
                self.refs.append(ref)
            for v in s.values():
                self._collect(v, depth + 1)
        elif isinstance(s, list):
            for v in s:
                self._collect(v, depth + 1)

    def _resolve(self, ref: str) -> Any:
        node = self.root
        for part in ref[1:].strip("/").split("/") if ref.strip("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return _MISSING
        return node

    def value(self, s: Any, depth: int = 0) -> bool:
        """Whether ``s`` has a finite value, taking references in :attr:`done` as finite."""
        if s is _MISSING or s is True or depth > 256 or not isinstance(s, dict):
            return s is not False
        if "const" in s:
            return True
        if isinstance(s.get("enum"), list):
            return bool(s["enum"])
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in self.done:
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and not any(self.value(v, depth + 1) for v in s[key]):
                return False
        if isinstance(s.get("allOf"), list) and not all(self.value(v, depth + 1) for v in s["allOf"]):
            return False
        t = s.get("type")
        types = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
        if not types:
            types = ["object"] if "properties" in s or "required" in s else ["array"] if "items" in s else ["any"]
        return any(self._typed(s, t, depth) for t in types)

    def _typed(self, s: dict[str, Any], t: str, depth: int) -> bool:
        if t == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            extra = s.get("additionalProperties", True)
            required = s.get("required") if isinstance(s.get("required"), list) else []
            return all(self.value(props.get(k, extra if not s.get("patternProperties") else True), depth + 1)
                       for k in required if isinstance(k, str))
        if t == "array":
            n = s.get("minItems", 0)
            n = n if isinstance(n, int) and not isinstance(n, bool) else 0
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            items = s.get("items", True)
            wanted = prefix[:n] + [items] * (1 if n > len(prefix) else 0)
            return all(self.value(v, depth + 1) for v in wanted)
        return True
