"""No silent violation of a grammar: a request whose grammar the worker cannot enforce ends with ``finish_reason``
``"error"`` and the reason, never ``"stop"``, and the engine serves its other requests on.

Forced the ways they happen: a grammar compiled for another tokenizer (its fingerprint differs from the worker's),
and an llguidance matcher that errs mid-generation (the worker's parser limits tighter than the compile's: its row
limit follows ``DEEPINFER_GRAMMAR_MAX_PROPERTIES``, and 600 optional properties need more than its floor of 2000
items at the first key of their object). Both through the in-process engine, serial and with the async pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.constraint import Constraint
from deepinfer.engine.structured import LocalConstraints
from deepinfer.grammar import Compiler, GrammarSpec

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)},
        "additionalProperties": False}  # fmt: skip
NESTED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "inner": WIDE},
          "required": ["name", "inner"], "additionalProperties": False}  # fmt: skip
SMALL = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_errors") / "m", seed=0)


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "async"])
def llm(model_dir, request) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=128, page_size=16, async_scheduling=request.param)


def run(llm: LLM, requests: list[tuple[SamplingParams, Constraint | None]]) -> dict[str, object]:
    """Queue the requests (prompt "Tell me a story"), step until every one finished; outputs by request id."""
    ids = llm.tokenizer.encode("Tell me a story", add_special_tokens=False).ids
    rids = []
    for params, constraint in requests:
        rid = llm.engine.new_request_id()
        llm.engine.add_request(rid, ids, params, constraint=constraint)
        rids.append(rid)
    outs: dict[str, object] = {}
    for _ in range(500):
        if not llm.engine.has_unfinished_requests():
            break
        outs.update({o.request_id: o.outputs[0] for o in llm.engine.step()})
    assert set(outs) == set(rids), "every request finishes"
    return {rid: outs[rid] for rid in rids}


def test_a_grammar_for_another_tokenizer_ends_with_an_error(llm: LLM) -> None:
    good = llm.constraints.for_request({"schema_type": "json_schema", "schema": SMALL}, [0])
    other = dataclasses.replace(good.grammar, tokenizer_fingerprint="0" * 64, cache_key="another-tokenizer")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20)
    bad, plain, ok = run(llm, [(params, Constraint(other)), (params, None), (params, good)]).values()
    assert bad.finish_reason == "error" and bad.token_ids == [], bad
    assert bad.error.startswith("constraint.grammar: compiled for tokenizer 000000000000"), bad.error
    assert plain.finish_reason in ("stop", "length") and plain.error is None  # the others are served
    assert ok.finish_reason == "stop" and json.loads(ok.text)["a"] in ("x", "y")


def test_an_llguidance_matcher_error_mid_generation_ends_with_an_error(llm: LLM, monkeypatch) -> None:
    grammar = Compiler(llm.model_path, cache_bytes=0, backend="llguidance").compile(
        GrammarSpec("json_schema", json.dumps(NESTED))
    )
    # the worker's limits: a row of at most 2000 items (the compile's: 6 per allowed property, 12000)
    monkeypatch.setenv("DEEPINFER_GRAMMAR_MAX_PROPERTIES", "1")
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=30)
    bad, plain = run(llm, [(params, Constraint(grammar)), (params, None)]).values()
    assert bad.finish_reason == "error", bad
    assert bad.error.startswith("constraint.grammar: the grammar matcher failed:"), bad.error
    assert "max is 2000" in bad.error, bad.error
    assert bad.text.startswith('{"name":"') and len(bad.token_ids) >= 3, bad  # it failed mid-generation
    assert plain.finish_reason in ("stop", "length") and plain.error is None


def test_generate_says_error_never_stop(llm: LLM, monkeypatch) -> None:
    """Through ``LLM.generate``: the compile sees the default limits (a cached compile), the worker tighter ones."""
    so = {"schema_type": "json_schema", "schema": NESTED}
    monkeypatch.setenv("DEEPINFER_GRAMMAR_BACKEND", "llguidance")
    monkeypatch.setattr(llm, "constraints", LocalConstraints(llm.model_path, llm.tokenizer))
    llm.constraints.for_request(so, [0])  # compiled (and cached) under the compile's limits
    monkeypatch.setenv("DEEPINFER_GRAMMAR_MAX_PROPERTIES", "1")
    out = llm.generate(["Tell me a story", "1 2 3"], [SamplingParams(max_tokens=20, so_args=so),
                                                      SamplingParams(max_tokens=5)])  # fmt: skip
    assert out[0].outputs[0].finish_reason == "error" and "max is 2000" in out[0].outputs[0].error
    assert out[1].outputs[0].finish_reason in ("stop", "length")


def test_offline_compiles_are_time_bounded(llm: LLM, monkeypatch) -> None:
    """A schema whose compile runs past ``DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S`` is refused with a ValueError naming
    the setting, within about the bound, and nothing is queued; the engine serves on."""
    slow = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i + 5}}}$"} for i in range(30)},
    }  # xgrammar: ~1 s
    monkeypatch.setenv("DEEPINFER_GRAMMAR_BACKEND", "xgrammar")
    monkeypatch.setattr(llm, "constraints", LocalConstraints(llm.model_path, llm.tokenizer))
    llm.constraints.for_request({"schema_type": "regex", "schema": "[ab]{2}"}, [0])  # the tokenizer views, unbounded
    monkeypatch.setenv("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "0.05")
    t0 = time.monotonic()
    with pytest.raises(
        ValueError, match=r"compile timed out after 0.05 s \(the limit: DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S\)"
    ):
        llm.generate("Tell me a story", SamplingParams(max_tokens=5, so_args={"schema_type": "json", "schema": slow}))
    assert time.monotonic() - t0 < 0.05 + 1.0
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    monkeypatch.setenv("DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S", "30")
    out = llm.generate(
        "Tell me a story", SamplingParams(max_tokens=20, so_args={"schema_type": "json", "schema": SMALL})
    )
    assert out[0].outputs[0].finish_reason == "stop" and json.loads(out[0].outputs[0].text)["a"] in ("x", "y")
