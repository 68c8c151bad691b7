"""The pre-compile checks: every abusive grammar is refused in milliseconds, with a reason naming what."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer import envs
from deepinfer.grammar import GrammarError, GrammarSpec, Limits, check_limits
from deepinfer.grammar.limits import bracket_depth, inspect_spec
from grammar.schemas import nested_arrays, nested_objects

LIMITS = Limits()  # the defaults, whatever the environment says


def refused(spec: GrammarSpec, limits: Limits = LIMITS) -> GrammarError:
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as info:
        check_limits(spec, limits)
    # milliseconds alone; 1 s bounds them on a loaded 2-core CI host (0.21 s seen beside another test run), where
    # a compile of these grammars would take minutes or never end
    assert time.perf_counter() - t0 < 1.0, spec.kind
    return info.value


TAG_REPEAT = {
    "type": "structural_tag",
    "format": {"type": "repeat", "min": 0, "max": 10**9, "content": {"type": "const_string", "value": "a"}},
}
TAG_REGEX = {"type": "structural_tag", "format": {"type": "regex", "pattern": "x{99999}"}}
ABUSE = {
    "500-deep objects": (GrammarSpec("json_schema", nested_objects(500)), "nesting depth 1001 exceeds the limit 64"),
    "500-deep arrays": (GrammarSpec("json_schema", nested_arrays(500)), "nesting depth 501 exceeds the limit 64"),
    "100k-deep brackets": (
        GrammarSpec("json_schema", '{"enum":[' + "[" * 100_000 + "]" * 100_000 + "]}"),
        "nesting depth 100002 exceeds the limit 64",
    ),
    "50 000 properties": (
        GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(50_000)}})),
        "more than 2000 properties",
    ),
    "10 MB schema": (
        GrammarSpec("json_schema", json.dumps({"description": "x" * 10_000_000})),
        "over the limit of 1048576 bytes",
    ),
    "a{1000000}": (GrammarSpec("regex", "a{1000000}"), "repetition count 1000000 exceeds the limit 10000"),
    "pattern a{1000000}": (
        GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^a{1000000}$"})),
        "/pattern: repetition count 1000000",
    ),
    "a{2,1000000} in ebnf": (GrammarSpec("ebnf", 'root ::= "a"{2,1000000}'), "repetition count 1000000"),
    "huge digits": (GrammarSpec("regex", "a{" + "9" * 5000 + "}"), "repetition count 999999999999..."),
    "50 000 enum values": (GrammarSpec("json_schema", json.dumps({"enum": list(range(50_000))})), "enum values"),
    "10 MB regex": (GrammarSpec("regex", "a" * 10_000_000), "over the limit of 131072 bytes"),
    "invalid JSON": (GrammarSpec("json_schema", '{"type": "object",'), "not valid JSON"),
    "NaN": (GrammarSpec("json_schema", '{"type": "number", "minimum": NaN}'), "NaN is not valid JSON"),
    "array schema": (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object, not an array"),
    "bool schema": (GrammarSpec("json_schema", "true"), "must be a JSON object, not a boolean"),
    "unknown kind": (GrammarSpec("xml", "<a/>"), "unknown grammar kind 'xml'"),
    "NUL": (GrammarSpec("regex", "a\x00b"), "NUL"),
    "lone surrogate": (GrammarSpec("ebnf", 'root ::= "\ud800"'), "not valid UTF-8"),
    "empty regex": (GrammarSpec("regex", "  "), "empty"),
    "tag repeat": (GrammarSpec("structural_tag", json.dumps(TAG_REPEAT)), "/format/max: repetition count 1000000000"),
    "tag regex": (GrammarSpec("structural_tag", json.dumps(TAG_REGEX)), "/format/pattern: repetition count 99999"),
    "patternProperties key": (
        GrammarSpec("json_schema", json.dumps({"type": "object", "patternProperties": {"^a{50000}$": {}}})),
        "repetition count 50000",
    ),
}


@pytest.mark.parametrize("case", list(ABUSE))
def test_abuse_is_refused_fast_with_the_reason(case: str) -> None:
    spec, reason = ABUSE[case]
    error = refused(spec)
    assert reason in str(error), str(error)
    assert str(error).startswith(spec.kind if spec.kind != "xml" else "unknown")
    assert error.outcome in ("limit", "invalid")


def test_limits_are_inclusive() -> None:
    check_limits(GrammarSpec("json_schema", nested_arrays(63)), LIMITS)  # 63 arrays + the integer = 64 levels
    assert "depth 65 " in str(refused(GrammarSpec("json_schema", nested_arrays(64))))
    check_limits(GrammarSpec("regex", "a{10000}b{3,10000}c{10000,}"), LIMITS)
    refused(GrammarSpec("regex", "a{10001}"))
    props = {f"p{i}": {"type": "integer"} for i in range(2000)}
    check_limits(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": props})), LIMITS)
    props["one_more"] = {}
    assert "more than 2000 properties" in str(refused(GrammarSpec("json_schema", json.dumps({"properties": props}))))
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": dict(list(props.items())[:1000])},
                                               "b": {"type": "object", "properties": props}}}  # fmt: skip
    assert "properties" in str(refused(GrammarSpec("json_schema", json.dumps(nested))))  # counted over all objects


def test_size_is_counted_in_utf8_bytes() -> None:
    limits = Limits(max_schema_bytes=100)
    text = json.dumps({"description": "é" * 40}, ensure_ascii=False)  # 59 characters, 99 bytes
    check_limits(GrammarSpec("json_schema", text), limits)
    error = refused(GrammarSpec("json_schema", text.replace("é", "éé", 1)), limits)
    assert "101 bytes, over the limit of 100 bytes" in str(error)


def test_escaped_braces_are_not_repetitions() -> None:
    check_limits(GrammarSpec("regex", r"a\{1000000}"), LIMITS)
    check_limits(GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": r"^\{99999\}$"})), LIMITS)
    refused(GrammarSpec("regex", r"\\{1000000}"))  # an escaped backslash, then a real repetition


def test_json_object_ignores_its_text() -> None:
    check_limits(GrammarSpec("json_object", ""), LIMITS)
    check_limits(GrammarSpec("json_object", "anything"), LIMITS)


def test_limits_come_from_the_environment() -> None:
    spec = GrammarSpec("json_schema", nested_arrays(5))
    check_limits(spec)
    with envs.override(DEEPINFER_GRAMMAR_MAX_DEPTH=3):
        with pytest.raises(GrammarError, match="nesting depth 6 exceeds the limit 3"):
            check_limits(spec)
    with envs.override(DEEPINFER_GRAMMAR_MAX_REPEAT=5):
        with pytest.raises(GrammarError, match="repetition count 6 exceeds the limit 5"):
            check_limits(GrammarSpec("regex", "a{6}"))


def test_a_one_mib_schema_is_checked_quickly() -> None:
    props = {f"field_{i}": {"type": "string", "description": "d" * 400, "maxLength": 30} for i in range(1900)}
    text = json.dumps({"type": "object", "properties": props})
    assert 0.7 * 1024**2 < len(text) < 1024**2
    t0 = time.perf_counter()
    found = inspect_spec(GrammarSpec("json_schema", text), LIMITS)
    assert time.perf_counter() - t0 < 0.5
    assert "field_1899" in found.strings


def test_structural_tag_token_ids_are_collected() -> None:
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": 128821},
        {"type": "token_triggered_tags", "trigger_tokens": [128806], "tags": []},
        {"type": "const_string", "value": "x"},
    ]}}  # fmt: skip
    found = inspect_spec(GrammarSpec("structural_tag", json.dumps(tag)), LIMITS)
    assert found.token_ids == {128821, 128806}


def test_bracket_depth_skips_strings() -> None:
    assert bracket_depth('{"a": "[[[{{{", "b": [[1]], "c": "\\"[["}') == 3
    assert bracket_depth("[" * 2000 + "]" * 2000) == 2000
