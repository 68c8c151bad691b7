"""Merging two JSON schemas into one that accepts exactly the values both accept (``allOf``, a ``$ref`` with
siblings, a sibling ``type`` carried into each ``anyOf`` / ``oneOf`` branch).

The inputs are schemas the schema pass has already normalized (no ``allOf``, no ``const``, no ``$ref`` except a
recursive one); the result may need normalizing again (a branch's ``anyOf`` is distributed by the caller).
:class:`Never` says the intersection accepts no value; a merge that cannot be written exactly raises
:class:`~deepinfer.grammar.spec.GrammarError` naming the keyword and its JSON path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from deepinfer.grammar.spec import GrammarError

__all__ = ["ANNOTATIONS", "COMPOSITIONS", "Merger", "Never", "canonical", "type_set"]

# Keywords that never restrict a value (kept from the first schema of a merge).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema",
    "$id", "$anchor", "$vocabulary",
})  # fmt: skip
COMPOSITIONS = ("anyOf", "oneOf")
TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


class Never(Exception):
    """The schema accepts no value; ``str(e)`` says why."""


def canonical(value: Any) -> str:
    """A JSON value's identity for set operations (``1`` and ``true`` differ, key order does not)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def type_set(schema: dict) -> set[str] | None:
    """The JSON types ``schema`` names (``integer`` without ``number``), None when it names none."""
    t = schema.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _intersect_types(a: Any, b: Any, path: str) -> str | list[str]:
    left = {a} if isinstance(a, str) else set(a)
    right = {b} if isinstance(b, str) else set(b)
    out = left & right
    if "integer" in left and "number" in right or "number" in left and "integer" in right:
        out.add("integer")
    if "number" in out and not ("number" in left and "number" in right):
        out.discard("number")
    if not out:
        raise Never(f"{path or '/'}: the types {sorted(left)} and {sorted(right)} have no value in common")
    ordered = [t for t in TYPES if t in out]
    return ordered[0] if len(ordered) == 1 else ordered


def _merge_enum(a: list, b: list, path: str) -> list:
    keep = {canonical(v) for v in b}
    out = [v for v in a if canonical(v) in keep]
    if not out:
        raise Never(f"{path or '/'}: no enum value is allowed by both schemas")
    return out


def _merge_multiple(a: Any, b: Any, path: str) -> Any:
    if a == b:
        return a
    if all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (a, b)):
        return a * b // math.gcd(a, b)
    raise GrammarError(f"json_schema: {path}/multipleOf: allOf of two multipleOf values {a} and {b} is not supported")


class Merger:
    """Merges with ``finish`` (normalize a merged child again) supplied by the schema pass."""

    def __init__(self, finish: Callable[[dict, str], dict]) -> None:
        self.finish = finish

    def merge(self, a: dict, b: dict, path: str) -> dict:
        """The schema of the values both ``a`` and ``b`` accept (raw: the caller normalizes it)."""
        if not a:
            return dict(b)
        if not b:
            return dict(a)
        for side in (a, b):
            if "$ref" in side:
                raise GrammarError(
                    f"json_schema: {path}/$ref: a recursive $ref combined with other keywords (allOf, siblings or "
                    "an anyOf/oneOf branch) is not supported"
                )
        if any(k in a for k in COMPOSITIONS) and any(k in b for k in COMPOSITIONS):
            raise GrammarError(
                f"json_schema: {path}: combining two anyOf/oneOf (through allOf or $ref) is not supported"
            )
        out = dict(a)
        if "required" in b:
            out["required"] = list(dict.fromkeys([*a.get("required", []), *b["required"]]))
        for key, value in b.items():
            if key == "required" or key in ANNOTATIONS and key in out:
                continue
            if key not in out:
                out[key] = value
            elif key not in ("properties", "additionalProperties"):
                out[key] = self._keyword(key, out[key], value, path)
        if any(k in x for x in (a, b) for k in ("properties", "additionalProperties", "patternProperties")):
            self._merge_objects(a, b, out, path)
        return out

    def _keyword(self, key: str, x: Any, y: Any, path: str) -> Any:
        where = f"{path}/{key}"
        if key == "type":
            return _intersect_types(x, y, path)
        if key == "enum":
            return _merge_enum(x, y, path)
        if key in _LOWER:
            return max(x, y)
        if key in _UPPER:
            return min(x, y)
        if key == "multipleOf":
            return _merge_multiple(x, y, path)
        if key == "uniqueItems":
            return bool(x or y)
        if key == "items":
            if x is False or y is False:
                return False
            return self.finish(self.merge(x, y, where), where)
        if key == "prefixItems":
            if len(x) != len(y):
                raise GrammarError(f"json_schema: {where}: allOf of prefixItems of different lengths is not supported")
            return [self.finish(self.merge(p, q, f"{where}/{i}"), f"{where}/{i}") for i, (p, q) in enumerate(zip(x, y))]
        if canonical(x) == canonical(y):
            return x
        raise GrammarError(f"json_schema: {where}: allOf with two different values of {key!r} is not supported")

    def _merge_objects(self, a: dict, b: dict, out: dict, path: str) -> None:
        """properties, additionalProperties: a property one side lists and the other does not must satisfy the
        other side's additionalProperties (false: it may not appear)."""
        if ("patternProperties" in a or "patternProperties" in b) and canonical(
            a.get("patternProperties")
        ) != canonical(b.get("patternProperties")):
            raise GrammarError(f"json_schema: {path}/patternProperties: allOf with patternProperties is not supported")
        required = set(out.get("required", []))
        props: dict[str, Any] = {}
        for name in dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]):
            where = f"{path}/properties/{name}"
            try:
                schema: dict = {}
                for side in (a, b):
                    if name in side.get("properties", {}):
                        part = side["properties"][name]
                        if part is False:
                            raise Never(f"{where}: may not appear")
                    elif side.get("additionalProperties", True) is False:
                        raise Never(f"{where}: not allowed by additionalProperties false")
                    else:
                        part = side.get("additionalProperties", {})
                        part = {} if part is True else part
                    schema = self.merge(schema, part, where)
                props[name] = self.finish(schema, where)
            except Never:
                if name in required:
                    raise
                props[name] = False
        if props or "properties" in a or "properties" in b:
            out["properties"] = props
        extra = [s.get("additionalProperties", True) for s in (a, b)]
        if False in extra:
            out["additionalProperties"] = False
        else:
            schemas = [{} if e is True else e for e in extra]
            merged = self.merge(schemas[0], schemas[1], f"{path}/additionalProperties")
            if merged:
                out["additionalProperties"] = self.finish(merged, f"{path}/additionalProperties")
            else:
                out.pop("additionalProperties", None)
