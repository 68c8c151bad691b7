"""Structured outputs and tool calls through the mesh: grammar service + worker + scheduler + balancer as real
processes on loopback, driven by the ``openai`` package and by grpcio.

With random weights the grammars have finite languages (see tests/engine/test_structured_outputs.py), so
every constrained run must end with a normal stop on EOS and a valid result.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import jsonschema
import openai
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

try:
    import httpx2 as httpx
except ImportError:  # older openai releases depend on httpx
    import httpx

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "rain": {"type": "boolean"},
        "celsius": {"type": "integer", "minimum": -20, "maximum": 45},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["city", "rain", "celsius", "note"],
    "additionalProperties": False,
}
STORY = [{"role": "user", "content": "Tell me a story about a cat. Do NOT answer in JSON, prose only."}]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "metric": {"type": "boolean"}},
            "required": ["city", "days"], "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("so_model"), seed=2)
    m = Mesh(model, tmp_path_factory.mktemp("so_logs")).up(http=True, grammar=True)
    yield m
    m.down()


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_response_format_json_schema_forces_valid_json(client: openai.OpenAI, model: str) -> None:
    for seed in (0, 1):
        res = client.chat.completions.create(
            model=model, messages=STORY, max_tokens=120, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}},
        )  # fmt: skip
        choice = res.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # streamed: the deltas concatenate to valid JSON
    stream = client.chat.completions.create(
        model=model, messages=STORY, max_tokens=120, temperature=1.0, seed=5, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
    )  # fmt: skip
    parts, finish = [], None
    for ev in stream:
        if ev.choices:
            parts.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def test_a_schema_only_llguidance_enforces_is_enforced_through_the_mesh(client: openai.OpenAI, model: str) -> None:
    """The grammar service's default backend, auto, compiles with llguidance a schema the schema pass refuses (a
    fractional multipleOf, minLength beside a pattern); the grammar travels to the worker saying so."""
    price = {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 20}
    code = {"type": "string", "pattern": "^(a|b)+$", "minLength": 2, "maxLength": 4}
    schema = {"type": "object", "additionalProperties": False, "required": ["price", "code"],
              "properties": {"price": price, "code": code}}  # fmt: skip
    for seed in (0, 1):
        res = client.chat.completions.create(
            model=model, messages=STORY, max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )  # fmt: skip
        choice = res.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_extra_body_regex_choice_grammar_and_completions(client: openai.OpenAI, model: str) -> None:
    res = client.chat.completions.create(
        model=model, messages=STORY, max_tokens=30, temperature=1.0, seed=2,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}},
    )  # fmt: skip
    assert res.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", res.choices[0].message.content)
    res = client.chat.completions.create(
        model=model, messages=STORY, max_tokens=30, extra_body={"guided_choice": ["yes", "no", "not sure"]}
    )
    assert res.choices[0].message.content in ("yes", "no", "not sure")
    grammar = 'root ::= "(" [0-9] ("," [0-9]){0,3} ")"'
    res = client.completions.create(
        model=model, prompt="Numbers:", max_tokens=30, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    assert res.choices[0].finish_reason == "stop" and re.fullmatch(r"\(\d(,\d){0,3}\)", res.choices[0].text)


def grpc_generate(mesh: Mesh, so: common_pb2.StructuredOutput | None, text: str = "Tell a story.") -> list:
    async def run():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            sampling = common_pb2.SamplingParams(temperature=1.0, seed=3, max_tokens=120)
            if so is not None:
                sampling.structured_output.CopyFrom(so)
            req = generation_pb2.GenerateRequest(text=text, sampling=sampling)
            return [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60)]

    return asyncio.run(run())


def test_grpc_so_args_and_model_info(mesh: Mesh) -> None:
    so = common_pb2.StructuredOutput(schema_type=common_pb2.StructuredOutput.SCHEMA_TYPE_JSON_SCHEMA,
                                     schema=json.dumps(SCHEMA))  # fmt: skip
    outs = grpc_generate(mesh, so)
    assert outs[-1].finished.reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads("".join(o.text for o in outs)), SCHEMA)
    kinds = common_pb2.StructuredOutput
    for kind, text, pattern in (
        (kinds.SCHEMA_TYPE_REGEX, r"(north|south)-[0-9]{1,3}", r"(north|south)-[0-9]{1,3}"),
        (kinds.SCHEMA_TYPE_EBNF, 'root ::= "[" [a-c] ("," [a-c]){0,2} "]"', r"\[[a-c](,[a-c]){0,2}\]"),
    ):
        outs = grpc_generate(mesh, kinds(schema_type=kind, schema=text), "Write an essay, no codes.")
        assert outs[-1].finished.reason == common_pb2.FINISH_REASON_STOP
        assert re.fullmatch(pattern, "".join(o.text for o in outs))

    async def info():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            return await generation_pb2_grpc.GenerationStub(ch).GetModelInfo(generation_pb2.GetModelInfoRequest())

    kinds = set(asyncio.run(info()).structured_output_types)
    assert {"regex", "json_schema", "json_object", "ebnf", "structural_tag"} <= kinds


def test_bad_grammars_are_refused_fast_and_the_mesh_stays_healthy(client: openai.OpenAI, mesh: Mesh, model) -> None:
    # 500 levels: built as text (json.dumps of such a dict overflows Python's recursion limit)
    deep = '{"type":"object","properties":{"a":' * 500 + '{"type":"integer"}' + "}}" * 500
    cases = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        {"extra_body": {"structured_outputs": {"regex": "(a|b"}}},
        {"extra_body": {"structured_outputs": {"regex": "a{1000000}"}}},
        {"extra_body": {"structured_outputs": {"json": {"type": "object", "properties": {
            f"p{i}": {"type": "integer"} for i in range(50_000)}}}}},
        {"extra_body": {"structured_outputs": {"json": deep}}},
        {"extra_body": {"structured_outputs": {"grammar": 'root ::= "a" ' + "x" * 2_000_000}}},  # under the body limit
    ]  # fmt: skip
    for kw in cases:
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=STORY, max_tokens=5, **kw)
        assert time.monotonic() - t0 < 3.0, kw  # the grammar service answers in <= 1 s; the rest is transport
        body = err.value.body
        assert body and body.get("message")
    # a keyword neither grammar backend can enforce: refused naming it (never compiled with the keyword ignored)
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    schema = {"type": "object", "properties": {"a": unique}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=STORY, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})  # fmt: skip
    assert "/properties/a/uniqueItems: uniqueItems: true is not enforced" in err.value.body["message"]
    # the same nesting as the JSON body itself: a 400, not a server error
    r = httpx.post(f"{mesh.http_url()}/v1/chat/completions", timeout=10, headers={"content-type": "application/json"},
                   content='{"model": "m", "messages": [], "x": ' + "[" * 100_000 + "]" * 100_000 + "}")  # fmt: skip
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    so = common_pb2.StructuredOutput(schema_type=common_pb2.StructuredOutput.SCHEMA_TYPE_REGEX, schema="(x")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        grpc_generate(mesh, so)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details().lower()
    ok = client.chat.completions.create(model=model, messages=STORY, max_tokens=4)
    assert ok.choices[0].finish_reason == "length"


def test_tool_calls_parse_and_validate_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    schema = TOOLS[0]["function"]["parameters"]
    messages = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        res = client.chat.completions.create(
            model=model, messages=messages, max_tokens=400, temperature=1.0, seed=4, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False,
        )  # fmt: skip
        msg = res.choices[0]
        assert msg.finish_reason == "tool_calls" and len(msg.message.tool_calls) == 1
        for call in msg.message.tool_calls:
            assert call.function.name == "get_weather" and call.id
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert not msg.message.content
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=400, temperature=1.0, seed=6, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    content, finish = "", None
    for ev in stream:
        if not ev.choices:
            continue
        d = ev.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or tc.id
            if tc.function is not None:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
        finish = ev.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls and "DSML" not in content and "<" not in content
    for c in calls.values():
        assert c["id"] and c["name"] == "get_weather"
        jsonschema.validate(json.loads(c["arguments"]), schema)


@pytest.mark.parametrize("max_tokens", [3, 12, 20])
def test_tool_call_cut_by_max_tokens_never_leaks_markup(client: openai.OpenAI, model: str, max_tokens: int) -> None:
    """tool_choice=required forces a tool call; max_tokens cuts it: finish_reason "length", no (partial) tool call,
    no markup in the content, streamed or not."""
    kw = {"model": model, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": max_tokens,
          "temperature": 1.0, "seed": 4, "tools": TOOLS, "tool_choice": "required"}  # fmt: skip
    res = client.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "length" and res.usage.completion_tokens == max_tokens
    assert not choice.message.tool_calls and not choice.message.content
    content, finish, calls = "", None, []
    for ev in client.chat.completions.create(stream=True, **kw):
        for c in ev.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "length" and not calls and content == ""


def test_grammar_service_down_fails_constrained_requests_fast_only(client: openai.OpenAI, mesh: Mesh, model) -> None:
    mesh.stop("grammar")
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model=model, messages=STORY, max_tokens=20, response_format={"type": "json_object"}
            )
        assert err.value.status_code == 503 and time.monotonic() - t0 < 3.0
        plain = client.chat.completions.create(model=model, messages=STORY, max_tokens=4)
        assert plain.choices[0].finish_reason == "length"
        # tool_choice auto without the grammar service: served unconstrained (the model's own format)
        auto = client.chat.completions.create(model=model, messages=STORY, max_tokens=4, tools=TOOLS)
        assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    finally:
        mesh.start_grammar()
    deadline = time.monotonic() + 5  # the balancer reconnects within its backoff (<= 1 s)
    while True:
        try:
            res = client.chat.completions.create(
                model=model, messages=STORY, max_tokens=30, extra_body={"structured_outputs": {"choice": ["a", "b"]}}
            )
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.2)
    assert res.choices[0].message.content in ("a", "b")
