"""No silent violation: every failure class found on real-world schemas, as small hand-written schemas, compiled
through the schema pass and generated token by token over the DeepSeek-V4 tokenizer with random and
adversarial choices among the tokens the grammar allows; each output is judged by the ``jsonschema`` package
against the schema as the user wrote it. Schemas the grammar cannot enforce are refused, naming the keyword.

The same walk over xgrammar's own compile of the raw schemas finds violations (the harness can fail).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import xgrammar
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from deepinfer.grammar import Compiler, GrammarError, GrammarSpec, build_tokenizer_info
from deepinfer.grammar.bounded_strings import narrowed
from deepinfer.grammar.schema_pass import normalize_schema

EOS = 1
OBJ_A = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["id"]}
SCHEMAS = {
    # allOf (with and without $ref), the type in one member: a bare string or array must not pass
    "allof_ref_object": {
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"ok": {"type": "boolean"}}}],
        "$defs": {"base": OBJ_A},
    },  # fmt: skip
    "allof_items": {
        "type": "array",
        "maxItems": 3,
        "items": {
            "allOf": [{"type": "object"}, {"properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}]
        },
    },  # fmt: skip
    "allof_sibling_type": {"type": "object", "allOf": [{"properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}]},
    # anyOf / oneOf branches that only name required properties: the sibling type and properties carried in
    "anyof_required_only": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
    },  # fmt: skip
    "oneof_discriminated": {
        "type": "object",
        "oneOf": [
            {
                "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1}},
                "required": ["kind", "r"],
            },
            {"properties": {"kind": {"const": "square"}, "side": {"type": "boolean"}}, "required": ["kind", "side"]},
        ],
    },  # fmt: skip
    # an optional group ending in a repetition: xgrammar alone lets the tail through without the head ("6K")
    "pattern_optional_group": {"type": "string", "pattern": "^(Z[0-9]{0,3})?K$"},
    "oneof_by_type": {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "null"}]},
    # dependencies: present trigger → dependents present
    "dependencies": {
        "type": "object",
        "properties": {"card": {"enum": ["visa"]}, "billing": {"enum": ["home"]}, "note": {"type": "boolean"}},
        "dependencies": {"card": ["billing"]},
    },  # fmt: skip
    "dependent_required": {
        "type": "object",
        "additionalProperties": False,
        "required": ["x"],
        "properties": {"x": {"type": "boolean"}, "y": {"type": "boolean"}, "z": {"type": "boolean"}},
        "dependentRequired": {"y": ["z"], "x": ["y"]},
    },  # fmt: skip
    # maxLength / minLength beside a pattern, and length-bounded strings (raw control characters)
    "pattern_and_lengths": {
        "type": "object",
        "required": ["code"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2, "maxLength": 4}},
    },  # fmt: skip
    "lengths_only": {
        "type": "object",
        "required": ["s", "t"],
        "properties": {
            "s": {"type": "string", "minLength": 2, "maxLength": 6},
            "t": {"type": "string", "minLength": 1},
        },
    },
    "enum_and_max_length": {"type": "string", "enum": ["ok", "toolong"], "maxLength": 3},
    "required_not_listed": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
    "type_list_with_bounds": {"type": ["integer", "null"], "minimum": 3, "maximum": 9},
    "draft4_tuple": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "array",
        "items": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
        "additionalItems": False,
    },  # fmt: skip
    "recursive": {"type": "object", "properties": {"v": {"enum": [0, 1]}, "next": {"$ref": "#"}}, "required": ["v"]},
}
# schema, the keyword path the refusal names
REFUSED = [
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        "/oneOf: branches 0 and 1",
    ),  # fmt: skip
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "/oneOf: branches 0 and 1"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "/properties/x/not:"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "/uniqueItems:"),
    (
        {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(ab)+$", "maxLength": 5}}},
        "/properties/x/maxLength:",
    ),  # fmt: skip
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": {"required": ["b"]}}},
        "/dependencies/a:",
    ),  # fmt: skip
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
            "dependencies": {"a": ["b"]},
        },
        "/dependencies: enforced only",
    ),  # fmt: skip
    ({"$ref": "https://example.com/s.json"}, "/$ref: only local references"),
    ({"$ref": "#/$defs/missing"}, "/$ref: '#/$defs/missing' does not resolve"),
    ({"type": "string", "format": "iri"}, "/format: format 'iri' is not enforced"),
    ({"type": "number", "multipleOf": 0.5}, "/multipleOf:"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "/if:"),
    ({"type": "array", "contains": {"const": 1}}, "/contains:"),
    ({"allOf": [{"type": "string", "pattern": "^a+$"}, {"pattern": "^b+$"}]}, "/pattern: allOf with two different"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "accepts no value"),
    ({"type": "string", "format": "date", "maxLength": 4}, "/maxLength: maxLength beside format"),
    ({"type": "object", "properties": {"o": {"required": "a"}}}, "/properties/o/required: expected a list"),
    ({"type": "string", "maxLength": -1}, "/maxLength: expected a non-negative integer"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False, "required": ["b"]},
        "accepts no value",
    ),  # fmt: skip
]


@pytest.fixture(scope="module")
def info() -> xgrammar.TokenizerInfo:
    return build_tokenizer_info()


@pytest.fixture(scope="module")
def compiler(info: xgrammar.TokenizerInfo) -> Compiler:
    return Compiler(cache_bytes=0, json_whitespace=0, backend="xgrammar")  # auto: see test_llguidance.py


@pytest.fixture(scope="module")
def vocab(info: xgrammar.TokenizerInfo) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray]:
    """Each token's bytes and length; which tokens are adversarial (control characters, quotes, backslashes,
    non-ASCII) and which close (they end strings, objects and arrays)."""
    tokens = [bytes(t) for t in info.decoded_vocab]
    adversarial = np.array([bool(t) and any(b < 0x20 or b in b'"\\' or b >= 0x80 for b in t) for t in tokens])
    closers = np.array([t in (b'"', b"}", b"]", b'"}', b'"]', b"}]", b"0", b"1", b"null") for t in tokens])
    return tokens, np.array([len(t) for t in tokens]), adversarial, closers


def walk(grammar_json: str, info: xgrammar.TokenizerInfo, vocab: tuple, seed: int, limit: int = 160) -> str:
    """Generate under the grammar: random / adversarial / longest tokens, closing after ``limit // 2`` steps."""
    tokens, lengths, adversarial, closers = vocab
    matcher = xgrammar.GrammarMatcher(xgrammar.CompiledGrammar.deserialize_json(grammar_json, info))
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    rng, out = random.Random(seed), []
    for step in range(limit):
        matcher.fill_next_token_bitmask(mask)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: info.vocab_size]
        allowed = np.flatnonzero(bits)
        closing = step > limit // 2
        if EOS in allowed and (closing or rng.random() < 0.2 or len(allowed) == 1):
            assert matcher.accept_token(EOS) and matcher.is_terminated()
            return b"".join(out).decode("utf-8")
        allowed = allowed[allowed != EOS]
        pool = allowed[closers[allowed]] if closing else allowed
        r = rng.random()
        if not closing and r < 0.45:
            pool = allowed[adversarial[allowed]]
        elif not closing and r < 0.6:
            pool = allowed[np.argmax(lengths[allowed])][None]
        pool = pool if len(pool) else allowed
        token = int(pool[rng.randrange(len(pool))])
        assert matcher.accept_token(token)
        out.append(tokens[token])
    pytest.fail(f"no EOS within {limit} tokens: {b''.join(out)!r}")


def judge(schema: dict, text: str) -> list[str]:
    """What the jsonschema package finds wrong with ``text`` under ``schema`` (formats checked)."""
    try:
        value = json.loads(text)  # strict: a raw control character in a string is invalid JSON
    except ValueError as e:
        return [f"invalid JSON: {e}"]
    cls = validator_for(schema, Draft202012Validator)
    return [e.message for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)]


@pytest.mark.parametrize("name", SCHEMAS)
def test_outputs_never_break_their_schema(name: str, compiler: Compiler, info, vocab) -> None:
    schema = SCHEMAS[name]
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    outputs = {walk(grammar.compiled_json, info, vocab, seed) for seed in range(24)}
    broken = {text: errors for text in outputs if (errors := judge(schema, text))}
    assert not broken, broken
    assert len(outputs) > 1 or name == "enum_and_max_length", outputs  # the walk explores


def test_bounded_strings_keep_xgrammars_bound_with_only_json_characters() -> None:
    """The character rule of xgrammar's bounded strings, as xgrammar prints it, is narrowed; an EBNF where a loose
    character class is left (another xgrammar's printing) is refused, never compiled as it is."""
    loose, safe = r"[^\"\\\r\n]", r"[^\0-\x1f\"\\]"
    text = str(xgrammar.Grammar.from_json_schema(json.dumps(SCHEMAS["lengths_only"]), any_whitespace=False))
    assert text.count(f"(({loose}))") == 2  # the two bounded strings' character rules
    fixed = narrowed(text)
    assert loose not in fixed and fixed.count(f"(({safe}))") == 2
    with pytest.raises(GrammarError, match="could not be restricted"):
        narrowed(text + f'extra ::= ({loose} "a")\n')


def test_the_walk_finds_xgrammars_own_violations(info, vocab) -> None:
    """Without the pass, xgrammar 0.2.9 lets through outputs that break these schemas."""
    raw = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    found = {}
    for name in ("allof_items", "anyof_required_only", "pattern_and_lengths", "lengths_only", "required_not_listed",
                 "enum_and_max_length"):  # fmt: skip
        schema = SCHEMAS[name]
        grammar = raw.compile_json_schema(json.dumps(schema), strict_mode=True, any_whitespace=False,
                                          separators=(",", ":")).serialize_json()  # fmt: skip
        texts = {walk(grammar, info, vocab, seed) for seed in range(24)}
        found[name] = [t for t in texts if judge(schema, t)]
    assert all(found.values()), found


@pytest.mark.parametrize(("schema", "named"), REFUSED, ids=[r[1][:30] for r in REFUSED])
def test_refused_naming_the_keyword(schema: dict, named: str, compiler: Compiler) -> None:
    with pytest.raises(GrammarError) as e:
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert named in str(e.value) and str(e.value).startswith("json_schema: "), str(e.value)


def test_rewrites() -> None:
    lengths = normalize_schema({"type": "string", "pattern": "[a-z]*", "minLength": 2, "maxLength": 5})
    assert lengths == {"type": "string", "pattern": "^[a-z]{2,5}$"}
    long = normalize_schema({"type": "string", "maxLength": 8192})  # lowered: the same strings up to 1024 chars
    assert long == {"type": "string", "maxLength": 1024}  # xgrammar's own bound, its characters narrowed
    with pytest.raises(GrammarError, match=r"/minLength: minLength 5000 is above 1024"):
        normalize_schema({"type": "string", "minLength": 5000})
    assert normalize_schema({"type": "string", "enum": ["a", "bcd"], "maxLength": 2}) == {"enum": ["a"]}
    recursive = normalize_schema(
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
    )
    assert recursive["$defs"]["r0"] == {"type": "array", "items": {"$ref": "#/$defs/r0"}}
    assert recursive["items"] == {"$ref": "#/$defs/r0"}
    one_of = normalize_schema({"oneOf": [{"type": "string"}, {"type": "integer"}], "title": "t"})
    assert one_of == {"title": "t", "anyOf": [{"type": "string"}, {"type": "integer"}]}
    dropped = normalize_schema({"type": "object", "anyOf": [{"type": "string"}, {"required": ["a"]}]})
    assert dropped == {"type": "object", "required": ["a"], "properties": {"a": {}}}


def test_expansion_is_bounded(compiler: Compiler) -> None:
    """Inlining shared definitions grows exponentially: refused by the node budget, in milliseconds."""
    defs = {"d0": {"type": "integer"}}
    for i in range(1, 30):
        defs[f"d{i}"] = {
            "type": "array",
            "items": {"anyOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]},
        }
    schema = {"$ref": "#/$defs/d29", "$defs": defs}
    with pytest.raises(GrammarError, match="nodes when its \\$ref, allOf and anyOf/oneOf are expanded") as e:
        compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert e.value.outcome == "limit"


@pytest.mark.parametrize("whitespace", [0, 2])
def test_after_the_value_only_eos(whitespace: int, info) -> None:
    """Once the JSON value is complete nothing but EOS may follow (no trailing whitespace, no second value)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = Compiler(cache_bytes=0, json_whitespace=whitespace, backend="xgrammar").compile(
        GrammarSpec("json_schema", json.dumps(schema))
    )
    matcher = xgrammar.GrammarMatcher(xgrammar.CompiledGrammar.deserialize_json(grammar.compiled_json, info))
    assert matcher.accept_string('{"a":12}')
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: info.vocab_size]
    assert np.flatnonzero(bits).tolist() == [EOS]


def test_structural_tag_schemas_pass_too(compiler: Compiler, info) -> None:
    """A tool call's JSON parameters (a structural tag's json_schema format) get the same pass."""
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    content = {"type": "json_schema", "json_schema": unique}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<r>", "end": "</r>", "content": content}}
    with pytest.raises(GrammarError, match=r"^structural_tag: /format/content/json_schema: /uniqueItems: "):
        compiler.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    tag["format"]["content"]["json_schema"] = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}
    grammar = compiler.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    for text, ok in (('<r>"abc"</r>', False), ('<r>"ab"</r>', True)):
        matcher = xgrammar.GrammarMatcher(xgrammar.CompiledGrammar.deserialize_json(grammar.compiled_json, info))
        assert (matcher.accept_string(text) and matcher.is_completed()) is ok, text


def test_optional_groups_are_written_so_xgrammar_enforces_them(compiler: Compiler, info) -> None:
    from deepinfer.grammar.schema_rules import optional_groups

    assert optional_groups(r"^(Z[0-9]*)?K$") == r"^(Z[0-9]*){0,1}K$"
    assert optional_groups(r"(a)??(?:b)?") == r"(a){0,1}?(?:b){0,1}"  # lazy kept; (?: opens, it is no quantifier
    for unchanged in (r"\)?", r"[)?]", r"[]?)]", r"a?b", r"[\]]?"):
        assert optional_groups(unchanged) == unchanged
    schema = json.dumps({"type": "string", "pattern": "^(Z[0-9]*)?K$"})
    compiled = compiler.compile(GrammarSpec("json_schema", schema))
    grammar = xgrammar.CompiledGrammar.deserialize_json(compiled.compiled_json, info)
    for text, ok in (('"6K"', False), ('"Z12K"', True), ('"K"', True), ('"ZK"', True)):
        assert xgrammar.GrammarMatcher(grammar).accept_string(text) is ok, text


def test_indented_json_is_laid_out_as_json_dumps_indent(info) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
        "type": "string", "maxLength": 3}}}, "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    value = {"a": 1, "b": ["x", "yz"]}
    indented = Compiler(json_indent=2, cache_bytes=0)
    assert indented.options != Compiler(cache_bytes=0).options  # a cached compact grammar is never reused
    compiled = indented.compile(GrammarSpec("json_schema", json.dumps(schema)))
    grammar = xgrammar.CompiledGrammar.deserialize_json(compiled.compiled_json, info)
    compact = json.dumps(value, separators=(",", ":"))
    cases = [(json.dumps(value, indent=2), True), (json.dumps(value), False), (json.dumps(value, indent=4), False)]
    for text, ok in [*cases, (compact, False)]:
        assert xgrammar.GrammarMatcher(grammar).accept_string(text) is ok, text
