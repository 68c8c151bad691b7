"""No silent violation of a grammar, through the mesh (grammar service + worker + scheduler + balancer as real
processes on loopback, driven by the ``openai`` package and by grpcio): a request whose grammar the worker cannot
enforce ends with a visible error — HTTP 500 naming ``constraint.grammar`` (non-stream), an SSE error event then
``[DONE]`` (stream), gRPC INTERNAL with the reason — while a concurrent request completes and the replica stays
healthy; the scheduler counts the failures.

Two deployments with a skew a real one can have:
* the worker's llguidance limits tighter than the grammar service's (its ``DEEPINFER_GRAMMAR_MAX_PROPERTIES``):
  the matcher errs mid-generation, after the first tokens were streamed;
* the worker's tokenizer file differs from the one the grammar was compiled for (another fingerprint): the worker
  refuses the grammar before the first token.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)

WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)},
        "additionalProperties": False}  # fmt: skip
# fine for the grammar service; on the worker the first key of "inner" needs a row of more than 2000 items
NESTED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "inner": WIDE},
          "required": ["name", "inner"], "additionalProperties": False}  # fmt: skip
SMALL = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("err_model"), seed=2)


@pytest.fixture(scope="module")
def tight(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The worker's llguidance row limit at its floor (2000 items); the grammar service compiles with llguidance."""
    m = Mesh(
        model_dir,
        tmp_path_factory.mktemp("err_tight"),
        service_env={
            "worker": {"DEEPINFER_GRAMMAR_MAX_PROPERTIES": "1"},
            "grammar": {"DEEPINFER_GRAMMAR_BACKEND": "llguidance"},
        },
    )
    yield m.up(http=True, grammar=True)
    m.down()


@pytest.fixture(scope="module")
def skewed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The worker's tokenizer.json is the same tokenizer written out again (other bytes: another fingerprint)."""
    worker_dir = tmp_path_factory.mktemp("err_worker_model")
    for f in model_dir.iterdir():
        os.symlink(f, worker_dir / f.name) if f.name != "tokenizer.json" else None
    (worker_dir / "tokenizer.json").write_text(json.dumps(json.loads((model_dir / "tokenizer.json").read_text()),
                                                          indent=1))  # fmt: skip
    m = Mesh(model_dir, tmp_path_factory.mktemp("err_skewed"), worker_model=worker_dir)
    yield m.up(http=True, grammar=True)
    m.down()


def client_of(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)


def chat(mesh: Mesh, schema: dict | None, stream: bool = False, seed: int = 0) -> tuple[str, str | None]:
    """(content, finish_reason) of one chat completion; raises the openai error."""
    c = client_of(mesh)
    extra = {"response_format": fmt(schema)} if schema is not None else {}
    model = c.models.list().data[0].id
    kw = dict(model=model, messages=STORY, max_tokens=60, temperature=1.0, seed=seed, **extra)
    if not stream:
        res = c.chat.completions.create(**kw)
        return res.choices[0].message.content or "", res.choices[0].finish_reason
    parts, finish = [], None
    for ev in c.chat.completions.create(stream=True, **kw):
        if ev.choices:
            parts.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
    return "".join(parts), finish


def raw_stream(mesh: Mesh, schema: dict) -> list[str]:
    """The SSE ``data:`` payloads of a streamed chat completion, as the server sent them."""
    body = {"messages": STORY, "max_tokens": 60, "temperature": 1.0, "seed": 0, "stream": True,
            "response_format": fmt(schema)}  # fmt: skip
    req = urllib.request.Request(f"{mesh.http_url()}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]


def grpc_generate(mesh: Mesh, schema: dict) -> tuple[list, grpc.aio.AioRpcError | None]:
    async def run():
        out = []
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            sampling = common_pb2.SamplingParams(temperature=1.0, seed=3, max_tokens=60)
            sampling.structured_output.CopyFrom(
                common_pb2.StructuredOutput(
                    schema_type=common_pb2.StructuredOutput.SCHEMA_TYPE_JSON_SCHEMA, schema=json.dumps(schema)
                )
            )
            req = generation_pb2.GenerateRequest(text="Tell a story.", sampling=sampling)
            try:
                async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60):
                    out.append(m)
            except grpc.aio.AioRpcError as e:
                return out, e
        return out, None

    return asyncio.run(run())


def failed_count(mesh: Mesh) -> float:
    text = urllib.request.urlopen(mesh.metrics_url("scheduler"), timeout=5).read().decode()
    found = re.search(r'deepinfer_scheduler_requests_total\{[^}]*outcome="failed"[^}]*\} (\S+)', text)
    return float(found[1]) if found else 0.0


def healthy(mesh: Mesh) -> None:
    """The replica serves on: health is ok and a constrained request and a plain one complete."""
    with urllib.request.urlopen(f"{mesh.http_url()}/health", timeout=5) as r:
        assert r.status == 200
    text, finish = chat(mesh, None, seed=4)
    assert finish in ("stop", "length")


def test_a_matcher_error_mid_generation_is_an_error_for_every_client(tight: Mesh) -> None:
    before = failed_count(tight)
    with ThreadPoolExecutor(3) as pool:  # concurrent requests complete: a plain one and one under a small schema
        plain = pool.submit(chat, tight, None, False, 1)
        small = pool.submit(chat, tight, SMALL, True, 2)
        with pytest.raises(openai.InternalServerError) as e:  # non-stream: a 500 naming the cause
            chat(tight, NESTED)
        assert plain.result()[1] in ("stop", "length")
        content, finish = small.result()
        assert finish == "stop" and jsonschema.validate(json.loads(content), SMALL) is None
    err = e.value.body
    assert e.value.status_code == 500 and err["code"] == "constraint_failed", err
    assert err["message"].startswith("constraint.grammar: the grammar matcher failed:") and "max is 2000" in err[
        "message"]  # fmt: skip
    # stream: the first tokens, then an error event, then [DONE] (and the openai client raises on the event)
    events = raw_stream(tight, NESTED)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert json.loads(events[-2])["error"]["message"].startswith("constraint.grammar:")
    contents = [json.loads(x)["choices"][0]["delta"].get("content") for x in events[:-2] if "choices" in x]
    assert "".join(c or "" for c in contents).startswith('{"name":"'), contents  # tokens came before the error
    assert not any(json.loads(x)["choices"][0]["finish_reason"] for x in events[:-2] if "choices" in x)
    with pytest.raises(openai.APIError, match="constraint.grammar"):
        chat(tight, NESTED, stream=True, seed=1)
    # gRPC: the tokens so far, then INTERNAL with the reason (never a finished message saying stop)
    out, error = grpc_generate(tight, NESTED)
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL, (out, error)
    assert error.details().startswith("constraint.grammar: the grammar matcher failed:")
    assert out and not any(m.HasField("finished") for m in out)
    assert failed_count(tight) - before == 4
    healthy(tight)


def test_a_grammar_the_worker_refuses_is_an_error_for_every_client(skewed: Mesh) -> None:
    before = failed_count(skewed)
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(chat, skewed, None, True, 1)
        with pytest.raises(openai.InternalServerError) as e:
            chat(skewed, SMALL)
        assert plain.result()[1] in ("stop", "length")
    assert e.value.body["code"] == "constraint_failed"
    assert e.value.body["message"].startswith("constraint.grammar: compiled for tokenizer"), e.value.body
    with pytest.raises(openai.APIError, match="constraint.grammar: compiled for tokenizer"):
        chat(skewed, SMALL, stream=True)  # refused before the first token: the error comes before the stream
    out, error = grpc_generate(skewed, SMALL)
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL
    assert error.details().startswith("constraint.grammar: compiled for tokenizer"), error.details()
    assert not any(m.HasField("finished") for m in out)
    assert failed_count(skewed) - before == 3
    healthy(skewed)
