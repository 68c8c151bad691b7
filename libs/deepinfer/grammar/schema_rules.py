"""The keyword check of the schema pass: every JSON-Schema keyword of a normalized schema is one xgrammar
enforces, is rewritten into one it enforces, or is refused naming the keyword and its JSON path.

Rewrites (each accepts only values the original accepts):

* ``minLength`` / ``maxLength`` without ``pattern`` stay xgrammar's own (a counted repetition of one character
  rule, fast to compile), whose characters the compiler narrows to those JSON allows unescaped (xgrammar's let
  raw control characters through: ``bounded_strings.py``); a bound above ``MAX_COUNTED_LENGTH`` (1024) is
  lowered to it, a minimum above it is refused;
* ``pattern`` that is one character class (or ``.``, ``\\d``, ``\\w`` ...) with a quantifier, plus
  ``minLength`` / ``maxLength`` → the same class with the bounds intersected (xgrammar ignores the lengths
  beside a pattern); any other pattern with a length bound is refused;
* an optional group in a ``pattern``, ``(...)?`` → ``(...){0,1}`` (the same language: xgrammar 0.2.9 compiles a
  schema's ``(Z[0-9]*)?K`` so that it accepts ``6K``, the group's tail without its head; its ``{0,1}`` is right);
* ``enum`` / ``const`` beside other keywords → the enum values that satisfy them (xgrammar checks only the enum);
* no ``type`` but keywords of one type → that type; a list of types with type-specific keywords → an ``anyOf``
  of one branch per type;
* a ``required`` property missing from ``properties`` → added (with the ``additionalProperties`` schema);
* ``oneOf`` → ``anyOf`` when its branches are provably disjoint (by type, enum values, or a required property
  whose schemas are disjoint or that a closed branch does not allow); otherwise refused.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.grammar.schema_merge import ANNOTATIONS, Never, type_set
from deepinfer.grammar.spec import GrammarError

__all__ = ["FORMATS", "check_node", "disjoint", "one_of", "optional_groups"]

# What xgrammar 0.2.9 enforces, by the type it applies to (checked by the tests against generated outputs).
_BY_TYPE = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "unevaluatedProperties"),
}  # fmt: skip
_KEYWORD_TYPE = {k: t for t, ks in _BY_TYPE.items() for k in ks if t != "integer"} | {"multipleOf": "integer"}
# Standard keywords (drafts 4 to 2020-12) that the grammar cannot enforce: refused wherever they appear.
_REFUSED = {
    "not": "'not' cannot be enforced by a grammar",
    "if": "'if'/'then'/'else' cannot be enforced", "then": "'if'/'then'/'else' cannot be enforced",
    "else": "'if'/'then'/'else' cannot be enforced",
    "contains": "'contains' is not enforced", "minContains": "'minContains' is not enforced",
    "maxContains": "'maxContains' is not enforced", "propertyNames": "'propertyNames' is not enforced",
    "dependentSchemas": "'dependentSchemas' is not enforced", "additionalItems": "'additionalItems' is not enforced",
    "contentEncoding": "'contentEncoding' is not enforced", "contentMediaType": "'contentMediaType' is not enforced",
    "contentSchema": "'contentSchema' is not enforced", "$dynamicRef": "'$dynamicRef' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported", "$dynamicAnchor": "'$dynamicAnchor' is not supported",
    "$recursiveAnchor": "'$recursiveAnchor' is not supported", "dependencies": "'dependencies' is not enforced",
    "dependentRequired": "'dependentRequired' is not enforced",
}  # fmt: skip
FORMATS = ("date", "time", "date-time", "duration", "email", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")  # fmt: skip
SAFE_CHAR = '[^"\\\\\\x00-\\x1f]'  # one character of a JSON string that needs no escape
# A counted repetition compiles in time that grows faster than its bound (xgrammar 0.2.9, ``[^"...]{0,n}``: 0.36 s
# at 1024, 9.6 s at 4096, 18 s at 8192): a rewritten length bound above this is lowered to it (every string it then
# allows, the schema allows too), a minimum above it is refused.
MAX_COUNTED_LENGTH = 1024
_ATOM = r"(\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\.)"
_QUANT = r"(\+|\*|\?|\{(\d+)\}|\{(\d+),(\d*)\})"
_SIMPLE_PATTERN = re.compile(rf"\^?{_ATOM}{_QUANT}\$?")


def _refuse(path: str, key: str, why: str) -> GrammarError:
    return GrammarError(f"json_schema: {path}/{key}: {why}")


def check_node(node: dict, path: str) -> dict:
    """A flat normalized schema (no ``allOf``, ``anyOf``, ``oneOf``) checked and rewritten (may return an
    ``anyOf``); raises :class:`GrammarError` for a keyword that cannot be enforced, :class:`Never`."""
    for key, value in node.items():
        if key in _REFUSED:
            raise _refuse(path, key, _REFUSED[key] + " (the schema is refused rather than the keyword ignored)")
        if key in ("unevaluatedProperties", "unevaluatedItems") and value is not False:
            raise _refuse(path, key, f"only {key}: false is supported")
    types = type_set(node)
    if "enum" in node:
        return _filter_enum(node, path)
    implied = {_KEYWORD_TYPE[k] for k in node if k in _KEYWORD_TYPE}
    if "integer" in implied:
        implied.discard("number")
    if types is None and implied:
        node = {**node, "type": [t for t in _BY_TYPE if t in implied]}
        types = set(node["type"])
        if len(types) == 1:
            node["type"] = next(iter(types))
    if types is not None and len(types) > 1 and implied & (types | ({"number"} if "integer" in types else set())):
        return {"anyOf": [check_node(_only_type(node, t), path) for t in sorted(types)]}
    if types is not None and len(types) == 1:
        t = next(iter(types))
        node = _check_typed(_only_type(node, t) if t in _BY_TYPE else node, t, path)
    return node


def _only_type(node: dict, t: str) -> dict:
    keep = set(_BY_TYPE.get(t, ())) | (set(_BY_TYPE["number"]) if t == "integer" else set())
    return {k: v for k, v in node.items() if k in keep or k in ANNOTATIONS} | {"type": t}


def _check_typed(node: dict, t: str, path: str) -> dict:
    if t == "string":
        return _check_string(node, path)
    if t in ("integer", "number"):
        if "multipleOf" in node:
            m = node["multipleOf"]
            if t == "number" or not isinstance(m, int) or isinstance(m, bool) or m <= 0:
                raise _refuse(path, "multipleOf", "only a positive integer multipleOf of an integer is enforced")
        lo = max((node[k] for k in ("minimum", "exclusiveMinimum") if k in node), default=None)
        hi = min((node[k] for k in ("maximum", "exclusiveMaximum") if k in node), default=None)
        if lo is not None and hi is not None and lo > hi:
            raise Never(f"{path or '/'}: minimum {lo} is above maximum {hi}")
        return node
    if t == "array":
        if node.get("uniqueItems") and node.get("maxItems", 2) > 1:
            raise _refuse(path, "uniqueItems", "uniqueItems: true is not enforced (only with maxItems <= 1)")
        node = {k: v for k, v in node.items() if k != "uniqueItems"}
        if node.get("minItems", 0) > node.get("maxItems", float("inf")):
            raise Never(f"{path or '/'}: minItems is above maxItems")
        if "items" not in node and "prefixItems" not in node and node.get("minItems", 0) > 0:
            node["items"] = {}  # xgrammar refuses minItems without items
        return node
    if t == "object":
        return _check_object(node, path)
    return node


def _check_object(node: dict, path: str) -> dict:
    props = dict(node.get("properties", {}))
    extra = node.get("additionalProperties", True)
    for name in node.get("required", []):
        if name in props:
            continue
        if extra is False or node.get("unevaluatedProperties", True) is False:
            raise Never(f"{path or '/'}/required: {name!r} is required but not allowed (additionalProperties)")
        if "patternProperties" in node:
            raise _refuse(path, "required", f"required {name!r} matched only by patternProperties is not supported")
        props[name] = {} if extra is True else extra
    if props or "properties" in node:
        node = {**node, "properties": props}
    if node.get("minProperties", 0) > node.get("maxProperties", float("inf")):
        raise Never(f"{path or '/'}: minProperties is above maxProperties")
    return node


def optional_groups(pattern: str) -> str:
    """``pattern`` with every group made optional by ``?`` written ``{0,1}`` (module docstring); escapes and character
    classes are read as such, so ``\\)?`` and ``[)?]`` stay as they are."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "]":  # a leading ] is a member of the class
                out.append("[]")
                i += 2
                continue
        elif c == ")" and pattern[i + 1 : i + 2] == "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _check_string(node: dict, path: str) -> dict:
    if isinstance(node.get("pattern"), str):
        node = {**node, "pattern": optional_groups(node["pattern"])}
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if hi is not None and lo > hi:
        raise Never(f"{path or '/'}: minLength {lo} is above maxLength {hi}")
    if "format" in node:
        if node["format"] not in FORMATS:
            raise _refuse(
                path, "format", f"format {node['format']!r} is not enforced (supported: {', '.join(FORMATS)})"
            )
        if lengths or "pattern" in node:
            key = lengths[0] if lengths else "pattern"
            raise _refuse(path, key, f"{key} beside format {node['format']!r} is not enforced")
        return node
    if not lengths:
        return node
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    if "pattern" not in node:  # xgrammar's own bounds (the compiler narrows their characters: bounded_strings.py)
        lo, hi = _clamped(lo, hi, path)
        bounds = ({"minLength": lo} if lo else {}) | ({} if hi is None else {"maxLength": hi})
        return {**rest, "type": "string", **bounds}
    m = _SIMPLE_PATTERN.fullmatch(node["pattern"])
    if m is None:
        raise _refuse(
            path, lengths[0],
            f"{lengths[0]} beside pattern {node['pattern'][:60]!r} is not enforced: combine them into the pattern "
            "(a length bound is rewritten only for a pattern of one character class with a quantifier)",
        )  # fmt: skip
    atom, quant, exact, qlo, qhi = m.groups()
    q_lo, q_hi = {"+": (1, None), "*": (0, None), "?": (0, 1)}.get(quant, (None, None))
    if exact is not None:
        q_lo = q_hi = int(exact)
    elif qlo is not None:
        q_lo, q_hi = int(qlo), int(qhi) if qhi else None
    lo = max(lo, q_lo)
    hi = q_hi if hi is None else hi if q_hi is None else min(hi, q_hi)
    if hi is not None and lo > hi:
        raise Never(f"{path or '/'}: the pattern's repetition and the length bounds leave no string")
    if atom == ".":
        atom = SAFE_CHAR
    return {**rest, "pattern": f"^{atom}{_bounds(lo, hi, path)}$"}


def _clamped(lo: int, hi: int | None, path: str = "") -> tuple[int, int | None]:
    """The length bounds enforced: a maximum above ``MAX_COUNTED_LENGTH`` lowered to it, a minimum above it refused."""
    lo, hi = int(lo), None if hi is None else min(int(hi), MAX_COUNTED_LENGTH)
    if lo > MAX_COUNTED_LENGTH:
        raise _refuse(path, "minLength", f"minLength {lo} is above {MAX_COUNTED_LENGTH}, the longest bound enforced")
    return lo, hi


def _bounds(lo: int, hi: int | None, path: str = "") -> str:
    lo, hi = _clamped(lo, hi, path)
    return f"{{{lo}}}" if hi == lo else f"{{{lo},{'' if hi is None else hi}}}"


def _validator(schema: dict) -> Any:
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    return validator_for(schema, Draft202012Validator)(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def _filter_enum(node: dict, path: str) -> dict:
    rest = {k: v for k, v in node.items() if k != "enum" and k not in ANNOTATIONS}
    values = node["enum"]
    if rest:
        if "$ref" in rest:
            raise _refuse(path, "enum", "enum beside a recursive $ref is not supported")
        check = _validator(rest)
        values = [v for v in values if check.is_valid(v)]
    if not values:
        raise Never(f"{path or '/'}/enum: no value satisfies the schema's other keywords")
    return {k: v for k, v in node.items() if k in ANNOTATIONS} | {"enum": values}


def disjoint(a: dict, b: dict) -> bool:
    """True when no JSON value can satisfy both (normalized) schemas; False when that is not proven."""
    if "anyOf" in a or "anyOf" in b:
        return all(disjoint(x, y) for x in a.get("anyOf", [a]) for y in b.get("anyOf", [b]))
    ta, tb = _json_types(a), _json_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    for x, y in ((a, b), (b, a)):
        if "enum" in x and "$ref" not in y:
            try:
                check = _validator(y)
                return not any(check.is_valid(v) for v in x["enum"])
            except Exception:  # a schema jsonschema cannot evaluate alone: not proven
                return False
    return _disjoint_objects(a, b)


def _json_types(schema: dict) -> set[str] | None:
    types = type_set(schema)
    if types is None and "enum" in schema:
        return {_value_type(v) for v in schema["enum"]}
    if types is not None and "integer" in types:
        types = types | {"number"}
    return types


def _value_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(v)]


def _disjoint_objects(a: dict, b: dict) -> bool:
    pa, pb = a.get("properties", {}), b.get("properties", {})
    for x, y, px, py in ((a, b, pa, pb), (b, a, pb, pa)):
        closed = y.get("additionalProperties", True) is False and "patternProperties" not in y
        for name in x.get("required", []):
            if closed and name not in py:
                return True
            if name in y.get("required", []) and name in px and name in py and disjoint(px[name], py[name]):
                return True
    return False


def one_of(branches: list[dict], path: str) -> dict:
    """``oneOf`` as the ``anyOf`` xgrammar enforces, when no value can match two branches."""
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            if not disjoint(a, branches[j]):
                raise GrammarError(
                    f"json_schema: {path}/oneOf: branches {i} and {j} may both match one value, and a grammar "
                    "cannot enforce 'exactly one'; use anyOf, or make the branches disjoint (different types, "
                    "enum/const values, or a required property with distinct const values)"
                )
    return {"anyOf": branches}
