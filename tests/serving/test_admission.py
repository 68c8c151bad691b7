"""Admission at the balancer's edge, as real processes on loopback with real clients: the fast capacity gate
(a burst is refused at once, before any tokenization or RPC), the body-size limit, tokenization off the event
loop, the request checks both front ends share, and a replica's CANCELLED never becoming a 500."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.serving.healthcheck import free_port, wait_serving
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2_grpc
from serving.mesh import Mesh

try:
    import httpx2 as httpx
except ImportError:  # older openai releases depend on httpx
    import httpx

pytestmark = pytest.mark.timeout(300)
MAX_BODY = 1 << 20  # DEEPINFER_MAX_REQUEST_BYTES of this module's mesh
DEFAULT_MAX_TOKENS = 24  # DEEPINFER_DEFAULT_MAX_TOKENS of this module's mesh
CONTEXT = 4096  # the tiny model's max_position_embeddings
LONG = {"temperature": 0, "max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("admission_model"), seed=5)


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    env = {"DEEPINFER_MAX_NUM_SEQS": "2", "DEEPINFER_MAX_REQUEST_BYTES": str(MAX_BODY),
           "DEEPINFER_DEFAULT_MAX_TOKENS": str(DEFAULT_MAX_TOKENS)}  # fmt: skip
    m = Mesh(model_dir, tmp_path_factory.mktemp("admission_logs"), extra_env=env).up(max_queued=2)
    yield m
    m.down()


def stub(address: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(address))


def ids_request(ids: list[int], **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(**sampling)
    )


def post(mesh: Mesh, path: str, body: dict | bytes, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        kw.setdefault("headers", {})["content-type"] = "application/json"
        return httpx.post(f"{mesh.http_url()}{path}", content=body, timeout=60, **kw)
    return httpx.post(f"{mesh.http_url()}{path}", json=body, timeout=60, **kw)


def scheduler_rejections(mesh: Mesh) -> float:
    text = httpx.get(mesh.metrics_url("scheduler")).text
    return float(re.search(r'deepinfer_scheduler_requests_total\{[^}]*outcome="rejected"[^}]*\} (\S+)', text)[1])


async def fill(mesh: Mesh, n: int) -> list[grpc.aio.UnaryStreamCall]:
    """``n`` long requests that hold the replica's places (running, then queued) until cancelled."""
    s, calls = stub(mesh.address("balancer")), []
    for k in range(n):  # one at a time: the replica queues at most max_queued before its next step
        calls.append(s.Generate(ids_request([0, 3 + k, 4], **LONG)))
        for _ in range(200):
            load = (await s.GetLoads(generation_pb2.GetLoadsRequest())).replicas[0]
            if (load.running_requests, load.waiting_requests) == (min(k + 1, 2), max(k - 1, 0)):
                break  # (a request waits until the replica's next step; until then it counts as queued)
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the long requests never filled the replica: {load}")
    return calls


# -- the admission gate --------------------------------------------------------------------------------
async def raw_post(port: int, path: str, body: bytes, headers: str = "") -> tuple[int, str, float]:
    """One HTTP/1.1 request on its own connection: (status, response head, seconds from connect to the end).

    A bare asyncio client: in a burst of thousands on two cores, httpx's own per-request work would dominate
    what is measured here (the server's time to answer)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nConnection: close\r\n{headers}"
    length = "" if "content-length" in headers.lower() else f"Content-Length: {len(body)}\r\n"
    writer.write(f"{head}{length}\r\n".encode() + body)
    data = await reader.read()
    writer.close()
    response_head = data.decode("latin-1").lower()
    return int(response_head.split(" ", 2)[1]), response_head, time.monotonic() - t0


async def wait_idle(mesh: Mesh) -> None:
    s = stub(mesh.address("balancer"))
    for _ in range(200):
        load = (await s.GetLoads(generation_pb2.GetLoadsRequest())).replicas[0]
        if (load.running_requests, load.waiting_requests) == (0, 0):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the replica never became idle: {load}")


def test_a_full_replica_is_refused_by_the_gate_on_both_front_ends(mesh: Mesh) -> None:
    async def run():
        calls = await fill(mesh, 4)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub(mesh.address("balancer")).Generate(ids_request([0, 9], max_tokens=2)).read()
            res = await asyncio.to_thread(post, mesh, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        finally:
            for c in calls:
                c.cancel()
        await wait_idle(mesh)
        return refused.value, res

    refused, res = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "every replica is full" in refused.details()
    assert res.status_code == 429 and res.headers["retry-after"] == "1"
    err = res.json()["error"]
    assert err["type"] == "rate_limit_error" and "every replica is full" in err["message"]


def test_a_grpc_burst_is_refused_by_the_gate_not_shed_by_the_transport(mesh: Mesh) -> None:
    """3000 calls at once on one channel: gRPC core on its own sheds calls beyond 1000 waiting for the application
    (as CANCELLED, which clients do not retry); the balancer's server takes them all, and its gate refuses each
    with RESOURCE_EXHAUSTED and a reason."""

    async def run():
        calls = await fill(mesh, 4)
        try:
            async with grpc.aio.insecure_channel(mesh.address("balancer")) as channel:
                s = generation_pb2_grpc.GenerationStub(channel)

                async def one() -> str:
                    try:
                        await s.Generate(ids_request([0, 9], max_tokens=2), timeout=120).read()
                        return "OK"
                    except grpc.aio.AioRpcError as e:
                        return e.code().name

                return await asyncio.gather(*(one() for _ in range(3000)))
        finally:
            for c in calls:
                c.cancel()
            await wait_idle(mesh)

    codes = asyncio.run(run())
    assert set(codes) == {"RESOURCE_EXHAUSTED"}, {c: codes.count(c) for c in set(codes)}


def test_a_burst_is_refused_at_once_with_429(mesh: Mesh) -> None:
    """2000 concurrent requests against 4 places (2 running + 2 queued): the admitted ones generate for seconds;
    every other one gets 429 + Retry-After (no 500, no 503) from the balancer's gate, long before that, without
    reaching the replica. (The gate knows the replica's capacity: the test above saw it refuse.)"""
    rejected_before = scheduler_rejections(mesh)
    body = json.dumps({"prompt": "Hello there", "max_tokens": 150, "ignore_eos": True}).encode()

    async def run():
        await wait_idle(mesh)
        return await asyncio.gather(*[raw_post(mesh.ports["http"], "/v1/completions", body) for _ in range(2000)])

    results = asyncio.run(run())
    statuses = sorted({s for s, _, _ in results})
    assert statuses == [200, 429], f"statuses: {statuses}"
    admitted = [t for s, _, t in results if s == 200]
    refused = [(head, t) for s, head, t in results if s == 429]
    assert len(admitted) <= 4 and len(admitted) + len(refused) == 2000
    assert all("\r\nretry-after: 1\r\n" in head for head, _ in refused)
    latencies = sorted(t for _, t in refused)
    median = statistics.median(latencies)
    print(f"refusals: median {median * 1e3:.0f} ms, max {latencies[-1] * 1e3:.0f} ms; "
          f"admitted: {len(admitted)}, the quickest {min(admitted):.1f} s")  # fmt: skip
    assert median < min(admitted) / 2
    # at most the places the gate let through reached the replica and were refused there (its queue counts a
    # request as waiting until its next step); the other refusals never left the balancer
    assert scheduler_rejections(mesh) - rejected_before <= 4


# -- the checks both front ends share ------------------------------------------------------------------
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', "temperature", ["finite"]),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature", []),
        ("/v1/completions", b'{"prompt": "x", "temperature": 1e39}', "temperature", ["finite"]),
        ("/v1/completions", {"prompt": "x", "temperature": 1e9}, "temperature", ["DEEPINFER_MAX_TEMPERATURE"]),
        ("/v1/completions", b'{"prompt": "x", "top_p": NaN}', "top_p", ["finite"]),
        ("/v1/completions", b'{"prompt": "x", "min_p": -Infinity}', "min_p", ["finite"]),
        ("/v1/completions", {"prompt": "Hello there", "max_tokens": 2**31 - 1}, "max_tokens",
         [str(2**31 - 1), "max_model_len=4096", "2 prompt tokens", "4094"]),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5000}, "max_tokens", ["5000", "max_model_len=4096"]),
        ("/v1/chat/completions", {"messages": []}, "messages", ["at least one message"]),
        ("/v1/completions", {"prompt": [0] * 5000}, "prompt", ["5000 tokens", "max_model_len=4096"]),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(mesh: Mesh, path, body, param, words) -> None:
    res = post(mesh, path, body)
    err = res.json()["error"]
    assert (res.status_code, err["param"], err["type"]) == (400, param, "invalid_request_error"), err
    assert all(w in err["message"] for w in words), err["message"]


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (ids_request([0, 5], temperature=float("inf")), ["temperature", "finite"]),
        (ids_request([0, 5], temperature=1e9), ["temperature", "DEEPINFER_MAX_TEMPERATURE"]),
        (ids_request([0, 5], top_p=float("nan")), ["top_p", "finite"]),
        (ids_request([0, 5], max_tokens=2**31 - 1), ["max_tokens", "max_model_len=4096", "2 prompt tokens"]),
        (ids_request([0] * 4096), ["prompt", "4096 tokens", "max_model_len=4096"]),
        (generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput()), ["messages", "at least one message"]),
    ],
)
def test_grpc_requests_get_the_same_checks(mesh: Mesh, request_, words) -> None:
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub(mesh.address("balancer")).Generate(request_).read()
        return e.value

    e = asyncio.run(run())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and all(w in e.details() for w in words), e.details()


def test_max_tokens_defaults_to_what_the_context_leaves(mesh: Mesh) -> None:
    """Absent max_tokens: a chat gets the context's rest, capped by DEEPINFER_DEFAULT_MAX_TOKENS (24 here); a
    completion 16, capped by the context's rest."""
    chat = post(mesh, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert chat["choices"][0]["finish_reason"] == "length"
    short = post(mesh, "/v1/completions", {"prompt": "Hello there", "ignore_eos": True}).json()
    assert short["usage"]["completion_tokens"] == 16
    near = post(mesh, "/v1/completions", {"prompt": [0] * (CONTEXT - 5), "ignore_eos": True}).json()
    assert near["usage"]["completion_tokens"] == 5 and near["choices"][0]["finish_reason"] == "length"

    async def grpc_chat():
        chat_input = generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(role="user", content="Hi")])
        req = generation_pb2.GenerateRequest(chat=chat_input, sampling=common_pb2.SamplingParams(ignore_eos=True))
        return [m async for m in stub(mesh.address("balancer")).Generate(req)][-1].finished.usage

    assert asyncio.run(grpc_chat()).completion_tokens == DEFAULT_MAX_TOKENS


def test_the_model_is_named_by_its_directory_never_its_path(mesh: Mesh, model_dir: Path) -> None:
    assert [m["id"] for m in httpx.get(f"{mesh.http_url()}/v1/models").json()["data"]] == [model_dir.name]
    res = post(mesh, "/v1/completions", {"model": model_dir.name, "prompt": "Hi", "max_tokens": 2}).json()
    assert res["model"] == model_dir.name
    assert post(mesh, "/v1/completions", {"model": str(model_dir), "prompt": "Hi"}).status_code == 404

    async def info():
        return await stub(mesh.address("balancer")).GetModelInfo(generation_pb2.GetModelInfoRequest())

    assert asyncio.run(info()).model == model_dir.name


# -- the body-size limit, tokenization off the event loop ---------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(mesh: Mesh) -> None:
    port = mesh.ports["http"]
    # Content-Length says too much: refused with no byte of the body sent
    status, head, _ = asyncio.run(raw_post(port, "/v1/completions", b"", f"Content-Length: {MAX_BODY + 1}\r\n"))
    body = json.loads(head.split("\r\n\r\n", 1)[1])
    assert status == 413 and body["error"]["code"] == "request_too_large" and str(MAX_BODY) in body["error"]["message"]

    def chunks():  # chunked (no Content-Length): refused once it has grown past the limit
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 65536 + 1):
            yield b"a" * 65536

    res = httpx.post(f"{mesh.http_url()}/v1/completions", content=chunks(), timeout=60,
                     headers={"content-type": "application/json"})  # fmt: skip
    assert res.status_code == 413 and res.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{mesh.http_url()}/health").status_code == 200


def test_health_answers_while_a_big_prompt_is_tokenized(mesh: Mesh) -> None:
    """A prompt just under the body limit takes the tokenizer most of a second (then it is refused: longer than
    the context); /health probes meanwhile answer in a small fraction of that."""
    words = "hello world, this is a fairly ordinary sentence with some words 12345. "
    text = (words * (MAX_BODY // len(words)))[: MAX_BODY - 200]
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()

    async def run():
        big = asyncio.create_task(raw_post(mesh.ports["http"], "/v1/completions", body))
        probes = []
        async with httpx.AsyncClient(base_url=mesh.http_url(), timeout=30) as client:
            while not big.done():
                t0 = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                probes.append(time.monotonic() - t0)
                await asyncio.sleep(0.01)
        return await big, probes

    (status, head, took), probes = asyncio.run(run())
    assert status == 400 and "max_model_len=4096" in head
    print(f"big prompt: {took:.2f} s; {len(probes)} /health probes, the slowest {max(probes) * 1e3:.0f} ms")
    assert len(probes) >= 5 and max(probes) < took / 4


# -- a replica that cancels: never a 500 ----------------------------------------------------------------
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """One place (max_running 1, max_queued 0); a prompt starting with token 1 is CANCELLED by the replica, any
    other one holds its place until the caller goes."""

    def __init__(self) -> None:
        self.submits = self.loads = 0

    def GetLoad(self, request, context):  # noqa: N802
        self.loads += 1
        return common_pb2.ReplicaLoad(max_running=1, max_queued=0)

    def Submit(self, request, context):  # noqa: N802
        self.submits += 1
        if request.prompt_token_ids[0] == 1:
            context.abort(grpc.StatusCode.CANCELLED, "the replica cancelled it")
        while context.is_active():
            time.sleep(0.01)
        yield from ()


@pytest.fixture(scope="module")
def fake(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real balancer process in front of an in-process fake scheduler (gRPC on loopback)."""
    from grpc_health.v1 import health, health_pb2_grpc

    servicer, server = FakeScheduler(), grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    m = Mesh(model_dir, tmp_path_factory.mktemp("fake_logs"), extra_env={"DEEPINFER_MIGRATION_LIMIT": "0"})
    m.ports.update(balancer=free_port(), http=free_port())
    m.start("balancer", ["services.balancer", "--model", str(model_dir), "--scheduler", f"127.0.0.1:{port}",
                         "--grpc-port", str(m.ports["balancer"]), "--http-port", str(m.ports["http"])])  # fmt: skip
    try:
        wait_serving(m.address("balancer"), proc=m.procs["balancer"])
        yield m, servicer
    finally:
        m.down()
        server.stop(0)


def test_the_gate_refuses_before_any_rpc(fake) -> None:
    m, servicer = fake
    for _ in range(100):  # the balancer asked the replica for its capacity at start
        if servicer.loads:
            break
        time.sleep(0.05)

    async def run():
        async with httpx.AsyncClient(base_url=m.http_url(), timeout=60) as client:
            holder = asyncio.create_task(client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}))
            while servicer.submits < 1:
                await asyncio.sleep(0.01)
            refused = await asyncio.gather(*[client.post("/v1/completions", json={"prompt": "x"}) for _ in range(20)])
            holder.cancel()  # the caller goes: its place frees
            return refused

    refused = asyncio.run(run())
    assert {r.status_code for r in refused} == {429} and servicer.submits == 1
    assert all(r.headers["retry-after"] == "1" for r in refused)


def test_a_request_the_replica_cancels_is_503_not_500(fake) -> None:
    m, servicer = fake
    for _ in range(2):  # twice: the first one's place was given back
        res = post(m, "/v1/completions", {"prompt": [1, 2], "max_tokens": 4})
        assert res.status_code == 503, res.text
        err = res.json()["error"]
        assert err["type"] == "service_unavailable_error" and "cancelled" in err["message"]

    async def via_grpc():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub(m.address("balancer")).Generate(ids_request([1, 2], max_tokens=4)).read()
        return e.value

    assert asyncio.run(via_grpc()).code() == grpc.StatusCode.UNAVAILABLE  # retryable; CANCELLED would be a lie
