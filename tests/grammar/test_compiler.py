"""In-process compilation against the DeepSeek-V4 tokenizer: every kind, compact JSON, control tokens, cache.

Each compiled grammar is checked the way a worker uses it: deserialized with the tokenizer info and driven by
an ``xgrammar.GrammarMatcher``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import xgrammar

from deepinfer.grammar import (
    CompiledGrammar,
    Compiler,
    GrammarError,
    GrammarSpec,
    build_tokenizer_info,
    control_token_ids,
    tokenizer_fingerprint,
)
from deepinfer.grammar.cache import GrammarCache
from deepinfer.grammar.vocab import tokenizer_path

THINK, THINK_END, CALLS_BEGIN, BOS = 128821, 128822, 128806, 0
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "rain": {"type": "boolean"},
        "celsius": {"type": "integer", "minimum": -20, "maximum": 45},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["city", "rain"],
}
A_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<r>", "end": "</r>",
                                            "content": {"type": "json_schema", "json_schema": A_SCHEMA}}}  # fmt: skip

CASES = {  # kind, text, accepted, refused
    "regex": ("regex", r"\d{4}-\d{2}-\d{2}", ["2026-11-29"], ["2026-1-29", "x"]),
    "ebnf": ("ebnf", 'root ::= "yes" | "no" | "maybe" [0-9]', ["yes", "maybe7"], ["yesno", "maybe"]),
    "json_schema": ("json_schema", json.dumps(SCHEMA), ['{"city":"Oslo","rain":false,"tags":["a","bc"]}'],
                    ['{"city": "Oslo", "rain": false}', '{"city":"Rome","rain":true}', '{"rain":true}']),
    "json_object": ("json_object", "", ["{}", '{"a":[1,{"b":null}],"c":"x"}'], ["[1]", '{"a": 1}', "{ }", "1"]),
    "structural_tag": ("structural_tag", json.dumps(TAG), ['<r>{"a":1}</r>', '<r>{"a": 1}</r>'],
                       ['<r>{"a":  1}</r>', '{"a":1}', "<r>{}</r>"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def info() -> xgrammar.TokenizerInfo:
    return build_tokenizer_info()


@pytest.fixture(scope="module")
def compiler(info: xgrammar.TokenizerInfo) -> Compiler:
    return Compiler(cache_bytes=64 * 1024**2, json_whitespace=0)


def matches(grammar: CompiledGrammar, info: xgrammar.TokenizerInfo, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(xgrammar.CompiledGrammar.deserialize_json(grammar.compiled_json, info))
    return matcher.accept_string(text) and matcher.is_completed()


def allowed_next(grammar: CompiledGrammar, info: xgrammar.TokenizerInfo, prefix: str) -> set[int]:
    matcher = xgrammar.GrammarMatcher(xgrammar.CompiledGrammar.deserialize_json(grammar.compiled_json, info))
    assert matcher.accept_string(prefix)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].tolist()
    return {i for i in range(info.vocab_size) if (words[i // 32] >> (i % 32)) & 1}


def test_tokenizer_info_masks_special_tokens(info: xgrammar.TokenizerInfo, compiler: Compiler) -> None:
    assert info.vocab_size == 129280 and info.stop_token_ids == [1]
    grammar = compiler.compile(GrammarSpec("json_schema", '{"type":"object","properties":{"s":{"type":"string"}}}'))
    inside_a_string = allowed_next(grammar, info, '{"s":"')
    assert BOS not in inside_a_string and 1 not in inside_a_string  # special: never inside constrained output
    assert THINK in inside_a_string  # control tokens stay allowed by xgrammar: the worker masks those not named
    assert grammar.allowed_control_token_ids == ()


def test_control_tokens_and_fingerprint(tmp_path: Path) -> None:
    controls = control_token_ids()
    assert len(controls) == 53 and controls[THINK] == "<think>" and controls[THINK_END] == "</think>"
    assert controls[CALLS_BEGIN] == "<｜tool▁calls▁begin｜>" and BOS not in controls and 1 not in controls
    packaged = tokenizer_path(None)
    assert tokenizer_fingerprint(None) == hashlib.sha256(packaged.read_bytes()).hexdigest()
    shutil.copy(packaged, tmp_path / "tokenizer.json")
    assert tokenizer_fingerprint(tmp_path) == tokenizer_fingerprint(None)
    assert tokenizer_fingerprint(tmp_path / "no-tokenizer-here") == tokenizer_fingerprint(None)
    (tmp_path / "tokenizer.json").write_bytes(packaged.read_bytes() + b" ")
    assert tokenizer_fingerprint(tmp_path) != tokenizer_fingerprint(None)


@pytest.mark.parametrize("case", list(CASES))
def test_each_kind_compiles_and_constrains(case: str, compiler: Compiler, info: xgrammar.TokenizerInfo) -> None:
    kind, text, accepted, refused = CASES[case]
    grammar = compiler.compile(GrammarSpec(kind, text))
    assert grammar.tokenizer_fingerprint == tokenizer_fingerprint(None) and len(grammar.cache_key) == 64
    for good in accepted:
        assert matches(grammar, info, good), good
    for bad in refused:
        assert not matches(grammar, info, bad), bad


def test_json_is_compact_by_default_and_whitespace_is_capped(info: xgrammar.TokenizerInfo) -> None:
    any_json = GrammarSpec("json_schema", "{}")
    compact = Compiler(cache_bytes=0, json_whitespace=0).compile(any_json)
    assert matches(compact, info, '[1,{"a":2}]') and not matches(compact, info, "[1, 2]")
    assert not matches(compact, info, "1 ")
    spaced = Compiler(cache_bytes=0, json_whitespace=2).compile(GrammarSpec("json_schema", '{"type":"object"}'))
    assert spaced.cache_key != Compiler(cache_bytes=0).key(GrammarSpec("json_schema", '{"type":"object"}'))
    assert matches(spaced, info, '{"a": 1}') and matches(spaced, info, '{ "a" :  1 }')
    assert not matches(spaced, info, '{"a":   1}')


def test_allowed_control_tokens_are_the_ones_the_grammar_names(compiler: Compiler) -> None:
    def named(kind: str, text: str) -> tuple[int, ...]:
        return compiler.compile(GrammarSpec(kind, text)).allowed_control_token_ids

    assert named("json_schema", json.dumps({"enum": ["<think>", "x"]})) == (THINK,)
    escaped = json.dumps({"const": "<｜tool▁calls▁begin｜>"})  # ensure_ascii: \uff5c ... in the text
    assert "\\uff5c" in escaped and named("json_schema", escaped) == (CALLS_BEGIN,)
    assert named("regex", "</think>[a-z]+") == (THINK_END,)
    assert named("ebnf", 'root ::= "<think>" [a-z]* "</think>"') == (THINK, THINK_END)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": THINK_END}, {"type": "const_string", "value": "ok"}]}}  # fmt: skip
    assert named("structural_tag", json.dumps(tag)) == (THINK_END,)
    assert named("json_object", "") == () and named("json_schema", json.dumps(SCHEMA)) == ()


def test_cache_hits_and_keys(info: xgrammar.TokenizerInfo) -> None:
    compiler = Compiler(cache_bytes=64 * 1024**2)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    first, cached = compiler.compile_cached(spec)
    assert not cached
    again, cached = compiler.compile_cached(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert cached and again is first and compiler.cache.hits == 1
    keys = {
        compiler.key(spec),
        compiler.key(GrammarSpec("json_object", spec.text)),
        compiler.key(GrammarSpec("json_schema", spec.text + " ")),
        compiler.key(GrammarSpec("regex", "a")),
        compiler.key(GrammarSpec("ebnf", "a")),
    }
    assert len(keys) == 5 and first.cache_key == compiler.key(spec)
    assert Compiler(cache_bytes=0).key(spec) == first.cache_key  # the same key in another compiler
    uncached = Compiler(cache_bytes=0)
    assert not uncached.compile_cached(spec)[1] and not uncached.compile_cached(spec)[1]


def test_xgrammar_errors_are_grammar_errors_without_source_paths() -> None:
    compiler = Compiler(cache_bytes=0, json_whitespace=0, backend="xgrammar")  # auto: llguidance takes a**
    bad = [
        ("json_schema", '{"type": "foo"}', 'json_schema: Unsupported type "foo"'),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "json_schema: "),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "json_schema: "),
        ("regex", "(ab", "regex: Regex parsing error at position 4: The parenthesis is not closed."),
        ("regex", "a**", "regex: "),
        ("ebnf", "root ::= undefined_rule", 'ebnf: EBNF parser error at line 1, column 10: Rule "undefined_rule"'),
        ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "nope"}}), "structural_tag: "),
    ]
    for kind, text, start in bad:
        with pytest.raises(GrammarError) as info:
            compiler.compile(GrammarSpec(kind, text))
        message = str(info.value)
        assert message.startswith(start), message
        assert ".cc" not in message and "/project/" not in message and "Check failed" not in message, message
        assert info.value.outcome == "invalid"
    with pytest.raises(GrammarError, match="repetition count"):
        compiler.compile(GrammarSpec("regex", "a{1000000}"))


def test_grammar_cache_is_capped_in_bytes() -> None:
    def grammar(key: str, size: int) -> CompiledGrammar:
        return CompiledGrammar("x" * size, key, "fp", ())

    cache = GrammarCache(3000)
    for key in "abc":
        assert cache.put(grammar(key, 700))
    assert cache.get("a") is not None  # a is now the most recently used
    assert cache.put(grammar("d", 700))  # evicts b
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    assert cache.used_bytes <= 3000 and cache.evictions == 1
    assert not cache.put(grammar("huge", 5000)) and cache.get("huge") is None
    assert not GrammarCache(0).put(grammar("a", 1))
