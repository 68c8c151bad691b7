"""The public APIs' keys, the served model name and malformed protobuf, as real processes on loopback with real
clients (the ``openai`` package, httpx, grpcio): the balancer runs with ``DEEPINFER_API_KEYS`` and
``--served-model-name``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

try:
    import httpx2 as httpx
except ImportError:  # older openai releases depend on httpx
    import httpx

pytestmark = pytest.mark.timeout(300)
KEYS = ("key-one", "key-two")
NAME = "deepinfer-test"
AUTH = (("authorization", f"Bearer {KEYS[0]}"),)
GARBAGE = [b"\xff\xff\xff\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xff\xfe", b"\x1a\x03\x08"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("auth_model"), seed=5)


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    m = Mesh(model_dir, tmp_path_factory.mktemp("auth_logs"), extra_env={"DEEPINFER_API_KEYS": ",".join(KEYS)},
             balancer_args=["--served-model-name", NAME]).up()  # fmt: skip
    yield m
    m.down()


def client(mesh: Mesh, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key=key, max_retries=0)


def generate(mesh: Mesh, request: generation_pb2.GenerateRequest, metadata=None) -> list:
    async def run():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            return [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(request, metadata=metadata)]

    return asyncio.run(run())


def grpc_error(mesh: Mesh, request: generation_pb2.GenerateRequest, metadata=None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        generate(mesh, request, metadata)
    return e.value


def text_request(model: str = "", **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text="Hi", model=model, sampling=common_pb2.SamplingParams(**sampling))


# -- HTTP ----------------------------------------------------------------------------------------------
def test_the_openai_client_with_a_key_is_served_under_the_served_name(mesh: Mesh) -> None:
    for key in KEYS:
        c = client(mesh, key)
        assert [m.id for m in c.models.list().data] == [NAME]
        res = c.completions.create(model=NAME, prompt="Hello", max_tokens=3)
        assert res.model == NAME and res.usage.completion_tokens == 3
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == NAME and chat.usage.completion_tokens == 2


def test_a_wrong_or_missing_key_is_401(mesh: Mesh) -> None:
    c = client(mesh, "not-a-key")
    with pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model=NAME, prompt="Hello", max_tokens=3)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    for path, headers in [
        ("/v1/models", {}),
        ("/v1/models", {"authorization": KEYS[0]}),  # no "Bearer "
        ("/v1/models", {"authorization": f"Bearer {KEYS[0]}x"}),
        ("/v1/no-such-route", {}),
    ]:
        res = httpx.get(f"{mesh.http_url()}{path}", headers=headers)
        assert res.status_code == 401 and res.headers["www-authenticate"] == "Bearer"
        assert res.json()["error"] | {"message": ""} == {
            "message": "", "type": "authentication_error", "param": None, "code": "invalid_api_key",
        }  # fmt: skip
    res = httpx.post(f"{mesh.http_url()}/v1/completions", json={"prompt": "x"}, headers={"authorization": "bearer x"})
    assert res.status_code == 401


def test_probes_metrics_and_version_stay_open(mesh: Mesh) -> None:
    for path in ("/health", "/ready", "/live", "/metrics", "/version"):
        assert httpx.get(f"{mesh.http_url()}{path}").status_code == 200, path


def test_a_request_naming_another_model_is_404(mesh: Mesh, model_dir: Path) -> None:
    c = client(mesh, KEYS[1])
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model=str(model_dir), prompt="Hello", max_tokens=3)  # the path is no name
    assert e.value.status_code == 404 and e.value.param == "model"


# -- gRPC ----------------------------------------------------------------------------------------------
def test_grpc_takes_the_key_as_metadata(mesh: Mesh) -> None:
    out = generate(mesh, text_request(max_tokens=3), AUTH)
    assert out[-1].finished.usage.completion_tokens == 3
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", KEYS[0]),)):
        e = grpc_error(mesh, text_request(max_tokens=3), metadata)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.details()
    e = grpc_error(mesh, text_request(model=NAME + "-other", max_tokens=3), AUTH)
    assert e.code() == grpc.StatusCode.NOT_FOUND

    async def info():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            found = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=AUTH)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())  # open
            return found, refused.value, health

    found, refused, health = asyncio.run(info())
    assert found.model == NAME and refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health.status == health_pb2.HealthCheckResponse.SERVING


# -- malformed protobuf --------------------------------------------------------------------------------
async def raw_call(address: str, method: str, payload: bytes, metadata=None) -> grpc.aio.AioRpcError:
    """``payload`` sent as the request's bytes, on a generic call (no serializer)."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call(payload, metadata=metadata, timeout=30):
                pass
        return e.value


def test_garbage_bytes_are_invalid_argument_and_the_services_stay_healthy(mesh: Mesh) -> None:
    async def run():
        found = []
        for payload in GARBAGE:
            found.append(await raw_call(mesh.address("balancer"), "/deepinfer.v1.Generation/Generate", payload, AUTH))
            found.append(await raw_call(mesh.address("scheduler"), "/deepinfer.v1.Scheduler/Submit", payload))
        anonymous = await raw_call(mesh.address("balancer"), "/deepinfer.v1.Generation/Generate", GARBAGE[0])
        return found, anonymous

    found, anonymous = asyncio.run(run())
    assert [e.code() for e in found] == [grpc.StatusCode.INVALID_ARGUMENT] * len(found)
    assert all("not a valid protobuf message" in e.details() for e in found)
    assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED  # the key is checked before the bytes are read
    assert generate(mesh, text_request(max_tokens=2), AUTH)[-1].finished.usage.completion_tokens == 2
    assert httpx.get(f"{mesh.http_url()}/health").status_code == 200
    for name in ("balancer", "scheduler", "worker"):
        assert mesh.procs[name].poll() is None and "Traceback" not in mesh.log(name)
