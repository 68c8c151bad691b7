"""The grammar service as a real process, driven by real grpcio clients: compiles, the cache, every abuse case
refused with INVALID_ARGUMENT in under a second, a slow grammar stopped at its time limit, a crashed compile
process replaced, metrics, and clients failing fast when the service is down."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import grpc
import pytest

from deepinfer.grammar import Compiler, GrammarClient, GrammarError, GrammarSpec, GrammarTimeout, GrammarUnavailable
from deepinfer.serving.healthcheck import check, free_port
from deepinfer.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from grammar.schemas import many_optional_properties, nested_arrays, nested_objects

pytestmark = pytest.mark.timeout(120)
ST = common_pb2.StructuredOutput
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name"]}  # fmt: skip


def compile_raw(address: str, schema_type: int, schema: str, timeout_s: float = 5.0, fingerprint: str = ""):
    """One Compile call with a plain grpcio stub: (response or None, status code, details, seconds)."""
    with grpc.insecure_channel(address) as channel:
        stub = grammar_pb2_grpc.GrammarStub(channel)
        request = grammar_pb2.CompileRequest(
            structured_output=ST(schema_type=schema_type, schema=schema),
            tokenizer_fingerprint=fingerprint,
            timeout_s=timeout_s,
        )
        grpc.channel_ready_future(channel).result(timeout=5)
        t0 = time.perf_counter()
        try:
            response = stub.Compile(request, timeout=timeout_s + 5)
            return response, grpc.StatusCode.OK, "", time.perf_counter() - t0
        except grpc.RpcError as e:
            return None, e.code(), e.details(), time.perf_counter() - t0


def test_compile_then_cached(grammar_service) -> None:
    text = json.dumps(SCHEMA)
    first, code, _, cold_s = compile_raw(grammar_service.address, ST.SCHEMA_TYPE_JSON_SCHEMA, text)
    assert code == grpc.StatusCode.OK and not first.cached
    second, _, _, warm_s = compile_raw(grammar_service.address, ST.SCHEMA_TYPE_JSON_SCHEMA, text)
    assert second.cached and second.grammar == first.grammar and second.compile_ms < first.compile_ms
    assert warm_s < cold_s
    grammar = first.grammar
    same = Compiler(cache_bytes=0, json_whitespace=0, backend="xgrammar")  # the fixture's service: xgrammar only
    assert grammar.cache_key == same.key(GrammarSpec("json_schema", text))
    assert len(grammar.tokenizer_fingerprint) == 64 and json.loads(grammar.compiled_json)

    async def through_the_client() -> None:
        client = GrammarClient(grammar_service.address)
        try:
            regex = await client.compile(GrammarSpec("regex", "</think>[0-9]{3}"))
            assert regex.allowed_control_token_ids == (128822,)
            again = await client.compile(GrammarSpec("json_schema", text), grammar.tokenizer_fingerprint)
            assert again.cache_key == grammar.cache_key and again.compiled_json == grammar.compiled_json
            tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "<think>"}}
            texts = {"ebnf": 'root ::= "a" | "b"', "json_object": "", "structural_tag": json.dumps(tag)}
            for kind, spec_text in texts.items():
                assert (await client.compile(GrammarSpec(kind, spec_text))).compiled_json
        finally:
            await client.close()

    asyncio.run(through_the_client())


ABUSE = [  # (schema type, text, a word of the reason)
    (ST.SCHEMA_TYPE_JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "strin"}}}', "Unsupported type"),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, '{"type": "object", "properties": ', "not valid JSON"),
    (ST.SCHEMA_TYPE_REGEX, "([a-z]+", "parenthesis is not closed"),
    (ST.SCHEMA_TYPE_EBNF, "root ::= nowhere", "not defined"),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, nested_objects(500), "nesting depth 1001 exceeds the limit 64"),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, nested_arrays(500), "nesting depth 501 exceeds the limit 64"),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, json.dumps({"properties": {f"p{i}": {} for i in range(50_000)}}), "properties"),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, json.dumps({"description": "x" * 10_000_000}), "over the limit of 1048576 bytes"),
    (ST.SCHEMA_TYPE_REGEX, "a{1000000}", "repetition count 1000000 exceeds the limit 10000"),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, json.dumps({"type": "string", "pattern": "a{1000000}"}), "/pattern: repetition"),
    (ST.SCHEMA_TYPE_UNSPECIFIED, "{}", "schema_type"),
    (ST.SCHEMA_TYPE_JSON_OBJECT, '{"type": "integer"}', "json_object takes no schema"),  # (not dropped)
    # keywords the grammar cannot enforce: refused by the schema pass, never ignored
    (ST.SCHEMA_TYPE_JSON_SCHEMA, json.dumps({"oneOf": [{"type": "integer"}, {"type": "number"}]}), "/oneOf: branches"),
    (
        ST.SCHEMA_TYPE_JSON_SCHEMA,
        json.dumps({"properties": {"s": {"pattern": "^(ab)+$", "maxLength": 3}}}),
        "/properties/s/maxLength: maxLength beside pattern",
    ),
    (ST.SCHEMA_TYPE_JSON_SCHEMA, json.dumps({"type": "array", "uniqueItems": True}), "/uniqueItems: "),
]


def test_abuse_is_invalid_argument_within_a_second(grammar_service) -> None:
    for schema_type, text, reason in ABUSE:
        _, code, details, seconds = compile_raw(grammar_service.address, schema_type, text)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (reason, code, details)
        assert reason in details, details
        assert seconds <= 1.0, (reason, seconds)
    _, code, details, _ = compile_raw(grammar_service.address, ST.SCHEMA_TYPE_REGEX, "[0-9]+", timeout_s=-1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in details
    response, code, _, _ = compile_raw(grammar_service.address, ST.SCHEMA_TYPE_REGEX, "[a-c]+x")
    assert code == grpc.StatusCode.OK and not response.cached  # still healthy
    assert "grammar_refused" in grammar_service.log()

    async def through_the_client() -> None:
        client = GrammarClient(grammar_service.address)
        try:
            with pytest.raises(GrammarError, match="repetition count 1000000"):
                await client.compile(GrammarSpec("regex", "a{1000000}"))
        finally:
            await client.close()

    asyncio.run(through_the_client())


def test_a_slow_grammar_meets_the_time_limit_and_the_service_keeps_serving(grammar_service) -> None:
    async def scenario() -> None:
        client = GrammarClient(grammar_service.address)
        try:
            t0 = time.perf_counter()
            with pytest.raises(GrammarTimeout, match="compile timed out after 1 s"):
                await client.compile(GrammarSpec("json_schema", many_optional_properties(2500)), timeout_s=1.0)
            assert time.perf_counter() - t0 < 2.5
            t0 = time.perf_counter()
            await client.compile(GrammarSpec("regex", "[0-9]{2}:[0-9]{2}"))  # the other compile process
            assert time.perf_counter() - t0 < 2.0  # (while the killed one is replaced on the same 2 cores)
        finally:
            await client.close()

    asyncio.run(scenario())
    assert check(grammar_service.address)


def test_a_crashed_compile_process_is_replaced(grammar_service) -> None:
    grammar_service.wait_idle_processes(2)  # the one killed by the previous test is back

    async def scenario() -> None:
        client = GrammarClient(grammar_service.address)
        try:
            slow = GrammarSpec("json_schema", many_optional_properties(2600))
            compiling = asyncio.create_task(client.compile(slow, timeout_s=10))
            await asyncio.sleep(0.3)
            os.kill(await asyncio.to_thread(grammar_service.busy_child), signal.SIGKILL)
            with pytest.raises(GrammarError, match="crashed on this grammar") as info:
                await compiling
            assert not isinstance(info.value, GrammarTimeout)
            t0 = time.perf_counter()
            grammar = await client.compile(GrammarSpec("regex", "(yes|no)!"))  # the other process
            assert grammar.compiled_json and time.perf_counter() - t0 < 2.0
        finally:
            await client.close()

    asyncio.run(scenario())
    assert check(grammar_service.address)


def test_another_tokenizer_is_refused(grammar_service) -> None:
    _, code, details, _ = compile_raw(grammar_service.address, ST.SCHEMA_TYPE_REGEX, "a", fingerprint="0" * 64)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer_fingerprint" in details

    async def through_the_client() -> None:
        client = GrammarClient(grammar_service.address)
        try:
            with pytest.raises(GrammarUnavailable, match="FAILED_PRECONDITION"):
                await client.compile(GrammarSpec("regex", "a"), tokenizer_fingerprint="0" * 64)
        finally:
            await client.close()

    asyncio.run(through_the_client())


def test_metrics_count_outcomes_hits_and_restarts(grammar_service) -> None:
    m = grammar_service.metric
    assert m("deepinfer_grammar_compiles_total", kind="json_schema", outcome="ok") >= 2
    assert m("deepinfer_grammar_compiles_total", kind="json_schema", outcome="limit") >= 5
    assert m("deepinfer_grammar_compiles_total", kind="json_schema", outcome="invalid") >= 1
    assert m("deepinfer_grammar_compiles_total", kind="regex", outcome="invalid") >= 1
    assert m("deepinfer_grammar_compiles_total", kind="json_schema", outcome="timeout") == 1
    assert m("deepinfer_grammar_compiles_total", kind="json_schema", outcome="crash") == 1
    assert m("deepinfer_grammar_cache_hits_total", kind="json_schema") >= 2
    assert m("deepinfer_grammar_cache_bytes") > 0 and m("deepinfer_grammar_cache_entries") >= 3
    assert m("deepinfer_grammar_process_restarts_total", reason="timeout") == 1
    assert m("deepinfer_grammar_process_restarts_total", reason="crash") >= 1
    assert m("deepinfer_grammar_compile_seconds_count", kind="json_schema", cached="true") >= 2


def test_clients_fail_fast_when_the_service_is_down(grammar_service) -> None:
    async def compile_fails_fast(client: GrammarClient) -> None:
        t0 = time.perf_counter()
        with pytest.raises(GrammarUnavailable, match="UNAVAILABLE"):
            await client.compile(GrammarSpec("regex", "[a-z]+"))
        assert time.perf_counter() - t0 < 1.0

    async def scenario() -> None:
        nowhere = GrammarClient(f"127.0.0.1:{free_port()}")  # never started
        connected = GrammarClient(grammar_service.address)
        try:
            await compile_fails_fast(nowhere)
            await connected.compile(GrammarSpec("regex", "[a-z]+"))
            assert await asyncio.to_thread(grammar_service.stop) == 0  # SIGTERM: a clean exit
            await compile_fails_fast(connected)
        finally:
            await nowhere.close()
            await connected.close()

    asyncio.run(scenario())
