"""Checks before compiling: a grammar over a limit is refused in milliseconds, never handed to xgrammar.

xgrammar cannot cancel a compile, and some inputs take minutes and gigabytes (50 000 properties: 526 s and
1.7 GB; 500-deep nesting: 16 s, measured with xgrammar 0.2), so every text is checked first (``DEEPINFER_GRAMMAR_*``):

* size: a JSON schema or structural tag at most ``MAX_SCHEMA_BYTES``; a regex, an EBNF grammar and each
  ``pattern`` / ``grammar`` inside a JSON document at most ``MAX_GRAMMAR_BYTES``; valid UTF-8, no NUL;
* JSON documents (``json_schema``, ``structural_tag``): valid JSON, an object, nesting at most ``MAX_DEPTH``
  objects and arrays deep, at most ``MAX_PROPERTIES`` ``properties`` entries and ``MAX_ENUM_VALUES`` ``enum``
  values in all;
* repetition counts ``{n}``, ``{n,}``, ``{n,m}`` in regexes, EBNF and patterns, and a structural tag's
  ``repeat`` bounds, at most ``MAX_REPEAT``.

The walk over a JSON document is iterative (Python's ``json.dumps`` recurses; ``json.loads`` of a document
deeper than the interpreter's recursion limit raises, and the depth is then measured by a bracket scan). The
grammar service's compile timeout is the backstop for whatever these checks let through.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from deepinfer import envs
from deepinfer.grammar.spec import JSON_KINDS, KINDS, GrammarError, GrammarSpec

__all__ = ["Inspection", "Limits", "check_limits", "inspect_spec"]

_ESCAPE = re.compile(r"\\.", re.S)
_REPEAT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
_STRUCTURE = re.compile(r'[\[\]{}"\\]')
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """The pre-compile limits (``from_env``: the ``DEEPINFER_GRAMMAR_MAX_*`` variables)."""

    max_schema_bytes: int = 1024**2
    max_grammar_bytes: int = 128 * 1024
    max_depth: int = 64
    max_properties: int = 2000
    max_enum_values: int = 10000
    max_repeat: int = 10000

    @classmethod
    def from_env(cls) -> Limits:
        return cls(
            max_schema_bytes=envs.DEEPINFER_GRAMMAR_MAX_SCHEMA_BYTES,
            max_grammar_bytes=envs.DEEPINFER_GRAMMAR_MAX_GRAMMAR_BYTES,
            max_depth=envs.DEEPINFER_GRAMMAR_MAX_DEPTH,
            max_properties=envs.DEEPINFER_GRAMMAR_MAX_PROPERTIES,
            max_enum_values=envs.DEEPINFER_GRAMMAR_MAX_ENUM_VALUES,
            max_repeat=envs.DEEPINFER_GRAMMAR_MAX_REPEAT,
        )


@dataclass
class Inspection:
    """What the checks learned about a spec: the parsed JSON document (JSON kinds), every string in it (keys
    and values; the text itself for regex / EBNF) and the token ids a structural tag names."""

    document: Any = None
    strings: list[str] = field(default_factory=list)
    token_ids: set[int] = field(default_factory=set)
    compile_text: str | None = None  # a JSON schema after the schema pass: what xgrammar compiles
    pass_error: GrammarError | None = None  # the schema pass's refusal, kept (``schema_pass="keep"``)


def check_limits(spec: GrammarSpec, limits: Limits | None = None, schema_pass: str = "raise") -> None:
    """Raise :class:`GrammarError` if ``spec`` is malformed or over a limit (fast: no compiling); ``schema_pass``
    as :func:`inspect_spec` (``skip``: the schema pass is left to the compiler, whose backend decides)."""
    inspect_spec(spec, limits, schema_pass)


def inspect_spec(spec: GrammarSpec, limits: Limits | None = None, schema_pass: str = "raise") -> Inspection:
    """:func:`check_limits`, returning what the checks parsed (reused by the compiler).

    ``schema_pass`` says what a JSON schema's pass does: ``raise`` its refusal (xgrammar compiles the
    rewrite), ``keep`` it in :attr:`Inspection.pass_error` (``auto``: llguidance may take the original),
    or ``skip`` the pass (llguidance compiles the schema as written)."""
    lim = limits if limits is not None else Limits.from_env()
    kind, text = spec.kind, spec.text
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not isinstance(text, str):
        raise GrammarError(f"{kind}: the grammar must be a string, not {type(text).__name__}")
    cap = lim.max_schema_bytes if kind in JSON_KINDS else lim.max_grammar_bytes
    _check_text(text, kind, "the grammar", cap)
    if kind == "json_object":
        return Inspection()
    if kind in ("regex", "ebnf"):
        if not text.strip():
            raise GrammarError(f"{kind}: the grammar is empty")
        _check_repeats(text, kind, "", lim.max_repeat)
        return Inspection(strings=[text])
    return _inspect_json(text, kind, lim, schema_pass)


def _check_text(text: str, kind: str, what: str, cap: int) -> None:
    if len(text) > cap:  # at least as many bytes as characters: refused before encoding anything
        raise GrammarError(f"{kind}: {what} has {len(text)} characters, over the limit of {cap} bytes", "limit")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise GrammarError(f"{kind}: {what} is not valid UTF-8 (a lone surrogate at character {e.start})") from None
    if size > cap:
        raise GrammarError(f"{kind}: {what} is {size} bytes, over the limit of {cap} bytes", "limit")
    if "\x00" in text:
        raise GrammarError(f"{kind}: {what} contains a NUL character at {text.index(chr(0))}")


def _check_repeats(text: str, kind: str, where: str, limit: int) -> None:
    """Refuse a repetition count over ``limit`` (escaped braces such as ``\\{`` are literal text)."""
    for m in _REPEAT.finditer(_ESCAPE.sub("", text)):
        for digits in m.groups():
            if digits and (len(digits) > 12 or int(digits) > limit):
                n = digits if len(digits) <= 12 else digits[:12] + "..."
                raise GrammarError(f"{kind}: {where}repetition count {n} exceeds the limit {limit}", "limit")


def _pointer(path: tuple | None) -> str:
    """``(((None, "properties"), "a"), "pattern")`` -> ``/properties/a/pattern`` (shortened when deep)."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
    text = "/" + "/".join(reversed(parts))
    return text if len(text) <= 200 else text[:95] + "/.../" + text[-95:]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _inspect_json(text: str, kind: str, lim: Limits, schema_pass: str = "raise") -> Inspection:
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        depth = bracket_depth(text)
        raise GrammarError(f"{kind}: nesting depth {depth} exceeds the limit {lim.max_depth}", "limit") from None
    except ValueError as e:
        raise GrammarError(f"{kind}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        what = "a JSON schema" if kind == "json_schema" else "a structural tag"
        raise GrammarError(f"{kind}: {what} must be a JSON object, not {_JSON_TYPES.get(type(doc), 'that')}")
    found = Inspection(document=doc)
    depth = _walk(doc, kind, lim, found)
    if depth > lim.max_depth:
        raise GrammarError(f"{kind}: nesting depth {depth} exceeds the limit {lim.max_depth}", "limit")
    if kind == "json_schema" and schema_pass == "keep":
        try:
            found.compile_text = _rewritten(doc, lim)
        except GrammarError as e:
            found.pass_error = e
    elif kind == "json_schema" and schema_pass != "skip":
        found.compile_text = _rewritten(doc, lim)
    elif kind == "structural_tag":
        from deepinfer.grammar.schema_pass import normalize_tag

        found.document = normalize_tag(doc)
    return found


def _rewritten(doc: dict, lim: Limits) -> str:
    """The schema pass's output, held to the same limits as the input (inlining $ref and distributing
    anyOf/oneOf can multiply properties and enum values)."""
    from deepinfer.grammar.schema_pass import normalize_schema

    text = json.dumps(normalize_schema(doc), ensure_ascii=False, separators=(",", ":"))
    what = "the schema after expanding $ref/allOf/anyOf"
    _check_text(text, "json_schema", what, lim.max_schema_bytes)
    try:
        _walk(json.loads(text), "json_schema", lim, Inspection())
    except GrammarError as e:
        raise GrammarError(f"{e} ({what})", e.outcome) from None
    return text


def _walk(doc: dict, kind: str, lim: Limits, found: Inspection) -> int:
    """Visit every node once (iteratively); returns the nesting depth, raises on the other limits."""
    strings, tag = found.strings, kind == "structural_tag"
    properties = enum_values = depth = 0
    stack: list[tuple[Any, int, tuple | None]] = [(doc, 1, None)]
    while stack:
        node, level, path = stack.pop()
        depth = max(depth, level)
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, dict | list):
                    stack.append((v, level + 1, (path, i)))
                elif isinstance(v, str):
                    strings.append(v)
            continue
        if tag:
            _tag_node(node, kind, lim, found, path)
        for k, v in node.items():
            strings.append(k)
            if isinstance(v, str):
                strings.append(v)
                if k in ("pattern", "grammar"):
                    where = f"{_pointer((path, k))}: "
                    _check_text(v, kind, where[:-2], lim.max_grammar_bytes)
                    _check_repeats(v, kind, where, lim.max_repeat)
            elif isinstance(v, dict | list):
                if k in ("properties", "patternProperties") and isinstance(v, dict):
                    properties += len(v)
                    if properties > lim.max_properties:
                        raise GrammarError(
                            f"{kind}: more than {lim.max_properties} properties (the limit) at {_pointer((path, k))}",
                            "limit",
                        )
                    if k == "patternProperties":
                        for pattern in v:
                            where = f"{_pointer((path, k))}: pattern {pattern[:40]!r}: "
                            _check_text(pattern, kind, where[:-2], lim.max_grammar_bytes)
                            _check_repeats(pattern, kind, where, lim.max_repeat)
                elif k == "enum" and isinstance(v, list):
                    enum_values += len(v)
                    if enum_values > lim.max_enum_values:
                        raise GrammarError(
                            f"{kind}: more than {lim.max_enum_values} enum values (the limit) at {_pointer((path, k))}",
                            "limit",
                        )
                stack.append((v, level + 1, (path, k)))
    return depth


def _tag_node(node: dict, kind: str, lim: Limits, found: Inspection, path: tuple | None) -> None:
    """Structural-tag formats: token ids they name, and the bounds of ``repeat``."""
    t = node.get("type")
    if t == "token" and isinstance(node.get("token"), int):
        found.token_ids.add(node["token"])
    elif t == "token_triggered_tags":
        found.token_ids.update(x for x in node.get("trigger_tokens") or () if isinstance(x, int))
    elif t == "token_dispatch":
        for rule in node.get("rules") or ():
            if isinstance(rule, list) and rule and isinstance(rule[0], int):
                found.token_ids.add(rule[0])
    elif t == "repeat":
        for bound in ("min", "max"):
            n = node.get(bound)
            if isinstance(n, int) and n > lim.max_repeat:
                raise GrammarError(
                    f"{kind}: {_pointer((path, bound))}: repetition count {n} exceeds the limit {lim.max_repeat}",
                    "limit",
                )


def bracket_depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` in JSON ``text`` (outside strings), without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for m in _STRUCTURE.finditer(text):
        c = m.group()
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = m.end() < len(text) and text[m.end()] in '\\"'
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest
