"""The second grammar backend, llguidance (``DEEPINFER_GRAMMAR_BACKEND``): the setting, ``auto``'s choice per
schema, refusals that name the keyword, the worker's llguidance matchers (masks equal to xgrammar's where both
allow the same tokens, EOS, whitespace, rollback, mixed batches) and the proto carrying the backend."""

from __future__ import annotations

import random

import jsonschema
import pytest
import torch

from deepinfer.chat.tokens import THINK_END
from deepinfer.engine.constraints import Constraint, ConstraintSet
from deepinfer.grammar import (
    Compiler,
    GrammarError,
    GrammarSpec,
    build_tokenizer_info,
    control_token_ids,
    grammar_from_proto,
    grammar_to_proto,
    tokenizer_fingerprint,
)
from deepinfer.grammar.llg import build_llg_tokenizer
from deepinfer.tokenizer import load_tokenizer

V, EOS = 129280, 1
SIMPLE = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}'
# refused by the schema pass (a fractional multipleOf), enforced by llguidance
FRACTIONAL = '{"type":"number","multipleOf":0.25,"minimum":0,"maximum":10}'
UNIQUE = '{"type":"array","items":{"type":"integer"},"uniqueItems":true}'  # refused by both


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compilers() -> dict[str, Compiler]:
    return {b: Compiler(None, cache_bytes=0, backend=b) for b in ("xgrammar", "llguidance", "auto")}


def make_set(fingerprint: str | None = None) -> ConstraintSet:
    controls = control_token_ids(None)
    by_text = {t: i for i, t in controls.items()}
    fp = tokenizer_fingerprint(None) if fingerprint is None else fingerprint
    return ConstraintSet(lambda: build_tokenizer_info(None), controls, V, EOS, by_text[THINK_END], fp,
                         llg_tokenizer=lambda: build_llg_tokenizer(None))  # fmt: skip


def allowed(cs: ConstraintSet, rid: str) -> list[int]:
    return ConstraintSet.allowed(cs.fill([rid]), V, "cpu")[0].nonzero().flatten().tolist()


def walk(cs: ConstraintSet, rid: str, rng: random.Random, limit: int = 300) -> list[int]:
    out: list[int] = []
    for _ in range(limit):
        ids = allowed(cs, rid)
        assert ids, "a constrained row must always allow something"
        t = EOS if EOS in ids and (len(ids) == 1 or rng.random() < 0.3) else rng.choice([i for i in ids if i != EOS])
        cs.accept(rid, t)
        out.append(t)
        if t == EOS:
            return out
    raise AssertionError("the grammar never allowed EOS")


def test_the_setting_chooses_the_backend_and_is_part_of_the_cache_key(monkeypatch) -> None:
    keys = set()
    for backend in ("xgrammar", "llguidance", "auto"):
        monkeypatch.setenv("DEEPINFER_GRAMMAR_BACKEND", backend)
        c = Compiler(None, cache_bytes=0)
        assert c.backend == backend
        keys.add(c.key(GrammarSpec("json_schema", SIMPLE)))
        want = "llguidance" if backend == "llguidance" else "xgrammar"
        assert c.compile(GrammarSpec("json_schema", SIMPLE)).backend == want
        assert c.compile(GrammarSpec("regex", "[ab]{2}")).backend == want
        assert c.compile(GrammarSpec("json_object", "")).backend == want
        assert c.compile(GrammarSpec("ebnf", 'root ::= "x"')).backend == "xgrammar"  # GBNF: xgrammar's only
    assert len(keys) == 3
    monkeypatch.setenv("DEEPINFER_GRAMMAR_BACKEND", "outlines")
    with pytest.raises(Exception, match="DEEPINFER_GRAMMAR_BACKEND"):
        Compiler(None, cache_bytes=0)
    with pytest.raises(ValueError, match="indented"):
        Compiler(None, cache_bytes=0, backend="llguidance", json_indent=2)
    indented = Compiler(None, cache_bytes=0, backend="auto", json_indent=2)  # auto keeps indented JSON on xgrammar
    assert indented.compile(GrammarSpec("json_schema", SIMPLE)).backend == "xgrammar"
    with pytest.raises(GrammarError, match="/multipleOf"):
        indented.compile(GrammarSpec("json_schema", FRACTIONAL))


def test_auto_takes_llguidance_only_for_what_the_pass_refuses(compilers) -> None:
    auto, xgr = compilers["auto"], compilers["xgrammar"]
    assert auto.compile(GrammarSpec("json_schema", SIMPLE)).backend == "xgrammar"
    with pytest.raises(GrammarError, match="/multipleOf"):
        xgr.compile(GrammarSpec("json_schema", FRACTIONAL))
    grammar = auto.compile(GrammarSpec("json_schema", FRACTIONAL))
    assert grammar.backend == "llguidance" and '"multipleOf":0.25' in grammar.compiled_json
    cs, rng = make_set(), random.Random(0)
    for i in range(6):
        cs.install(f"r{i}", Constraint(grammar))
        text = tok_text(walk(cs, f"r{i}", rng))
        jsonschema.validate(float(text), {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10})


def tok_text(ids: list[int]) -> str:
    return build_llg_tokenizer(None).decode_str([t for t in ids if t != EOS])


def test_a_schema_both_refuse_names_the_keyword(compilers) -> None:
    with pytest.raises(GrammarError, match=r"json_schema: /uniqueItems: .*llguidance refuses it too.*uniqueItems"):
        compilers["auto"].compile(GrammarSpec("json_schema", UNIQUE))
    with pytest.raises(GrammarError, match=r"llguidance: Unimplemented keys: \[\"uniqueItems\"\]"):
        compilers["llguidance"].compile(GrammarSpec("json_schema", UNIQUE))
    lenient = '{"x-guidance":{"lenient":true},' + UNIQUE[1:]  # a schema cannot make llguidance ignore keywords
    with pytest.raises(GrammarError, match="uniqueItems"):
        compilers["llguidance"].compile(GrammarSpec("json_schema", lenient))
    with pytest.raises(GrammarError, match="llguidance"):
        compilers["llguidance"].compile(GrammarSpec("regex", "(unclosed"))


@pytest.mark.parametrize("schema", ['{"type":"integer","minimum":-50,"maximum":999}', '{"enum":["yes","no",7]}',
                                    '{"type":"array","items":{"type":"boolean"},"maxItems":3}'])  # fmt: skip
def test_masks_equal_between_the_backends(compilers, schema) -> None:
    """Same tokens accepted, same mask words at every step (xgrammar's layout: bit t % 32 of word t // 32)."""
    cs, rng = make_set(), random.Random(1)
    for backend in ("xgrammar", "llguidance"):
        g = compilers[backend].compile(GrammarSpec("json_schema", schema))
        assert g.backend == backend
        cs.install(backend, Constraint(g))
    for _ in range(40):
        masks = cs.fill(["xgrammar", "llguidance"])
        assert torch.equal(masks[0], masks[1])
        ids = ConstraintSet.allowed(masks[:1], V, "cpu")[0].nonzero().flatten().tolist()
        t = EOS if EOS in ids and (len(ids) == 1 or rng.random() < 0.3) else rng.choice([i for i in ids if i != EOS])
        for rid in ("xgrammar", "llguidance"):
            cs.accept(rid, t)
        if t == EOS:
            break
    assert all(cs.matchers[r].matcher.is_terminated() and not cs.matchers[r].broken for r in ("xgrammar", "llguidance"))


def test_only_eos_follows_a_complete_value_and_whitespace_is_bounded(tok) -> None:
    cs = make_set()
    compact = Compiler(None, cache_bytes=0, backend="llguidance")
    cs.install("c", Constraint(compact.compile(GrammarSpec("json_schema", SIMPLE))))
    for t in tok.encode('{"a":12}').ids:
        cs.accept("c", t)
    assert allowed(cs, "c") == [EOS] and not cs.matchers["c"].broken
    loose = Compiler(None, cache_bytes=0, backend="llguidance", json_whitespace=2)
    ints = GrammarSpec("json_schema", '{"type":"array","items":{"type":"integer"}}')
    cs.install("w", Constraint(loose.compile(ints)))
    space = tok.token_to_id(" ") if tok.token_to_id(" ") is not None else tok.encode(" ").ids[0]
    for t in tok.encode("[1,").ids:
        cs.accept("w", t)
    cs.accept("w", space)
    cs.accept("w", space)
    assert space not in allowed(cs, "w")  # a third whitespace character in a row
    cs.install("s", Constraint(compact.compile(GrammarSpec("json_schema", '{"type":"string"}'))))
    cs.accept("s", tok.encode('"').ids[0])
    inside = set(allowed(cs, "s"))
    assert EOS not in inside and not inside & set(control_token_ids(None))  # no control token inside a string


def test_refused_tokens_rollback_and_a_mixed_batch(tok, compilers) -> None:
    cs = make_set()
    llg = compilers["llguidance"].compile(GrammarSpec("json_schema", SIMPLE))
    xgr = compilers["xgrammar"].compile(GrammarSpec("json_schema", SIMPLE))
    regex = compilers["llguidance"].compile(GrammarSpec("regex", "(red|blue)-[0-9]{2}"))
    for rid, g in (("l", llg), ("x", xgr), ("r", regex)):
        cs.install(rid, Constraint(g))
    solo = {rid: cs.fill([rid])[0] for rid in ("l", "x", "r")}
    batch = cs.fill(["r", "free", "l", "x"])  # each request fills its own row; an unconstrained one allows all
    assert torch.equal(batch[0], solo["r"]) and torch.equal(batch[2], solo["l"]) and torch.equal(batch[3], solo["x"])
    assert bool((batch[1] == -1).all())
    before = allowed(cs, "l")
    cs.accept("l", tok.encode("x").ids[0])  # refused: the matcher's state is unchanged, the request is held
    assert cs.matchers["l"].broken and allowed(cs, "l") == [EOS]
    assert cs.failure("l").startswith("constraint.grammar: the grammar refused the sampled token")  # reported
    cs.rollback("l", 1)
    assert not cs.matchers["l"].broken and allowed(cs, "l") == before and cs.failure("l") is None
    for t in [*tok.encode('{"a":3}').ids, EOS]:
        cs.accept("l", t)
    assert cs.matchers["l"].matcher.is_terminated() and allowed(cs, "l") == [EOS]
    cs.rollback("l", 1)  # EOS taken back: the value is complete, EOS allowed again, nothing else
    assert not cs.matchers["l"].matcher.is_terminated() and allowed(cs, "l") == [EOS]
    other = make_set(fingerprint="0" * 64)  # compiled for another tokenizer: refused, the request held to EOS
    other.install("l", Constraint(llg))
    assert other.matchers["l"].broken and allowed(other, "l") == [EOS]
    assert other.failure("l").startswith("constraint.grammar: compiled for tokenizer")


def test_the_proto_carries_the_backend(compilers) -> None:
    from deepinfer.v1 import common_pb2

    for backend in ("xgrammar", "llguidance"):
        g = compilers[backend].compile(GrammarSpec("json_schema", SIMPLE))
        message = common_pb2.CompiledGrammar.FromString(grammar_to_proto(g).SerializeToString())
        assert message.backend == backend and grammar_from_proto(message) == g
    old = common_pb2.CompiledGrammar(compiled_json="{}", cache_key="k")  # from before the field: xgrammar's
    assert grammar_from_proto(old).backend == "xgrammar"
