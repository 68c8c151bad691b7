"""llguidance through the compile processes: the grammar service (``auto``) compiles a schema the schema pass
refuses with llguidance, the grammar crosses gRPC saying so and a worker's matchers enforce it; ``auto`` falls
back to llguidance within the time limit when xgrammar's compile runs past its share."""

from __future__ import annotations

import asyncio
import json
import random
import time

import jsonschema
import pytest

from deepinfer.chat.tokens import THINK_END
from deepinfer.engine.constraints import Constraint, ConstraintSet
from deepinfer.grammar import (
    GrammarClient,
    GrammarError,
    GrammarSpec,
    GrammarTimeout,
    Limits,
    build_tokenizer_info,
    control_token_ids,
    tokenizer_fingerprint,
)
from deepinfer.grammar.llg import build_llg_tokenizer
from grammar.conftest import GrammarProcess
from grammar.schemas import many_optional_properties
from services.grammar.pool import CompilerPool

pytestmark = pytest.mark.timeout(120)
V, EOS = 129280, 1
# the schema pass refuses a fractional multipleOf and a maxLength beside a format; llguidance enforces both
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["price", "mail"],
          "properties": {"price": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 100},
                         "mail": {"type": "string", "format": "email", "maxLength": 12}}}  # fmt: skip
UNIQUE = '{"type":"array","items":{"type":"integer"},"uniqueItems":true}'  # refused by the pass and llguidance


def worker_outputs(grammar, n: int = 4, steps: int = 400) -> list[str]:
    """What a worker's matchers let a random walk write under ``grammar`` (finished outputs; with ``steps``
    too few to finish, the tokens so far, every one accepted)."""
    controls = control_token_ids(None)
    by_text = {t: i for i, t in controls.items()}
    cs = ConstraintSet(lambda: build_tokenizer_info(None), controls, V, EOS, by_text[THINK_END],
                       tokenizer_fingerprint(None), llg_tokenizer=lambda: build_llg_tokenizer(None))  # fmt: skip
    rng, texts = random.Random(0), []
    for i in range(n):
        cs.install(f"r{i}", Constraint(grammar))
        out = []
        for _ in range(steps):
            ids = ConstraintSet.allowed(cs.fill([f"r{i}"]), V, "cpu")[0].nonzero().flatten().tolist()
            t = EOS if EOS in ids else rng.choice(ids)
            cs.accept(f"r{i}", t)
            assert not cs.matchers[f"r{i}"].broken, "the matcher refused a token its mask allowed"
            if t == EOS:
                break
            out.append(t)
        assert cs.matchers[f"r{i}"].matcher.is_terminated() or steps < 400
        texts.append(build_llg_tokenizer(None).decode_str(out))
    return texts


def test_the_service_compiles_with_llguidance_and_a_worker_enforces_it(tmp_path) -> None:
    service = GrammarProcess(tmp_path, {"DEEPINFER_GRAMMAR_WORKERS": "1", "DEEPINFER_GRAMMAR_BACKEND": "auto"})
    service.start()

    async def compile_both() -> tuple:
        client = GrammarClient(service.address)
        try:
            llg = await client.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
            xgr = await client.compile(GrammarSpec("json_schema", '{"type":"integer"}'))
            with pytest.raises(GrammarError, match="uniqueItems"):  # refused by both
                await client.compile(GrammarSpec("json_schema", UNIQUE))
            return llg, xgr
        finally:
            await client.close()

    try:
        llg, xgr = asyncio.run(compile_both())
        # the compile metrics say which engine compiled (a refusal under auto: both tried)
        m, ok = service.metric, {"kind": "json_schema", "outcome": "ok"}
        assert m("deepinfer_grammar_compiles_total", **ok, backend="llguidance") == 1
        assert m("deepinfer_grammar_compiles_total", **ok, backend="xgrammar") == 1
        assert m("deepinfer_grammar_compiles_total", kind="json_schema", outcome="invalid", backend="auto") == 1
        for backend in ("llguidance", "xgrammar"):
            assert m("deepinfer_grammar_compile_seconds_count", kind="json_schema", cached="false",
                     backend=backend) == 1  # fmt: skip
    finally:
        assert service.stop() in (None, 0), service.log()
    assert llg.backend == "llguidance" and xgr.backend == "xgrammar"
    for text in worker_outputs(llg):
        jsonschema.validate(json.loads(text), SCHEMA, format_checker=jsonschema.FormatChecker())


def test_auto_falls_back_to_llguidance_when_xgrammar_runs_out_of_time() -> None:
    slow = GrammarSpec("json_schema", many_optional_properties(2500))  # xgrammar: seconds

    async def scenario(backend: str) -> tuple:
        pool = CompilerPool(workers=2, backend=backend, timeout_s=4.0, limits=Limits(max_properties=3000))
        try:
            await pool.start()
            t0 = time.perf_counter()
            try:
                grammar, _ = await pool.compile(slow)
            except GrammarTimeout as e:
                return e, time.perf_counter() - t0
            return grammar, time.perf_counter() - t0
        finally:
            await pool.close()

    # (no wall-clock bounds: the pool's own deadline decides, and a grammar, not a GrammarTimeout, means the fallback
    # compiled within it; how soon the event loop then returns depends on the machine's load)
    grammar, _ = asyncio.run(scenario("auto"))
    assert getattr(grammar, "backend", None) == "llguidance", grammar
    assert worker_outputs(grammar, 1, steps=40)[0].startswith("{")  # llguidance's row limit fits 2500 properties
    error, _ = asyncio.run(scenario("xgrammar"))
    assert isinstance(error, GrammarTimeout), error
