"""Admission control and graceful drain of the scheduler, as real processes on loopback."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.balancer.session_client import SessionClient
from serving.mesh import Mesh
from serving.test_mesh import collect, gen_request, stub

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lifecycle_model"), seed=5)


def submit(address: str, rid: str, ids: list[int], **sampling) -> grpc.aio.UnaryStreamCall:
    s = scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(address))
    return s.Submit(
        scheduler_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=ids, sampling=common_pb2.SamplingParams(**sampling)
        )
    )


async def wait_load(mesh: Mesh, waiting: int, running: int, timeout: float = 10.0) -> None:
    s = stub(mesh)
    deadline = time.monotonic() + timeout
    while True:
        load = (await s.GetLoads(generation_pb2.GetLoadsRequest())).replicas[0]
        if (load.waiting_requests, load.running_requests) == (waiting, running):
            return
        assert time.monotonic() < deadline, f"load never reached waiting={waiting} running={running}: {load}"
        await asyncio.sleep(0.05)


def test_a_full_queue_refuses_at_once(model_dir: Path, tmp_path: Path) -> None:
    m = Mesh(model_dir, tmp_path, extra_env={"DEEPINFER_MAX_NUM_SEQS": "1"}).up(max_queued=1, http=False)
    try:

        async def run():
            s = stub(m)
            long = dict(temperature=0, max_tokens=4000, ignore_eos=True)
            running = s.Generate(gen_request([0, 3, 4], **long))
            async for _ in running:  # the first request is running ...
                break
            waiting = s.Generate(gen_request([0, 5, 6], **long))
            await wait_load(m, waiting=1, running=1)  # ... and the second fills the queue
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as via_balancer:
                await collect(s, gen_request([0, 7, 8], max_tokens=4))
            waited = time.monotonic() - t0
            with pytest.raises(grpc.aio.AioRpcError) as direct:
                async for _ in submit(m.address("scheduler"), "direct-1", [0, 7, 8], max_tokens=4):
                    pass
            running.cancel()
            waiting.cancel()
            await wait_load(m, waiting=0, running=0)  # cancelled requests leave the queue and the batch
            _, toks, _ = await collect(s, gen_request([0, 7, 8], max_tokens=4, ignore_eos=True))
            return via_balancer.value, waited, direct.value, toks

        via_balancer, waited, direct, toks = asyncio.run(run())
        assert via_balancer.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and waited < 1.0
        assert direct.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued=1" in direct.details()
        assert len(toks) == 4  # served again once the queue has room
    finally:
        m.down()


async def fresh_sessions(address: str, n: int) -> dict[str, int]:
    """How ``n`` requests end, each sent over a new session stream of the balancer's client (status code names);
    "tasks left": the tasks left running once every stream is over (none should be)."""
    before = asyncio.all_tasks()
    codes: dict[str, int] = {}
    for i in range(n):
        channel = grpc.aio.insecure_channel(address)
        client = SessionClient(scheduler_pb2_grpc.SchedulerStub(channel), address)
        req = scheduler_pb2.SubmitRequest(request_id=f"fresh-{i}", prompt_token_ids=[0, 7, 8],
                                          sampling=common_pb2.SamplingParams(max_tokens=4))  # fmt: skip
        try:
            async for _ in client.submit(req):
                pass
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        codes[code] = codes.get(code, 0) + 1
        await client.close()
        await channel.close()
    for _ in range(300):  # (a task of grpc's ends a few turns of the loop after its call)
        left = [t for t in asyncio.all_tasks() - before if not t.done()]
        if not left:
            break
        await asyncio.sleep(0.01)
    return {**codes, **({"tasks left": len(left)} if left else {})}


def test_sigterm_drains_running_streams_and_exits_cleanly(model_dir: Path, tmp_path: Path) -> None:
    # a grace long enough for the stream to finish here (its last 5 s would hand what still runs off elsewhere)
    m = Mesh(model_dir, tmp_path).up(http=False, grace_s=40)
    sched, worker = m.procs["scheduler"], m.procs["worker"]
    try:

        async def run():
            s = stub(m)
            call = s.Generate(gen_request([0, 3, 4], temperature=0, max_tokens=300, ignore_eos=True))
            msgs = []
            async for msg in call:
                msgs.append(msg)
                break
            # the worker held while the checks run: the stream is certainly still running then, however fast the
            # host (the checks need the scheduler and the balancer only)
            worker.send_signal(signal.SIGSTOP)
            try:
                sched.send_signal(signal.SIGTERM)
                health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(m.address("scheduler")))
                deadline = time.monotonic() + 30
                while (
                    await health.Check(health_pb2.HealthCheckRequest())
                ).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, "health never turned NOT_SERVING"
                    await asyncio.sleep(0.02)
                with pytest.raises(grpc.aio.AioRpcError) as direct:
                    async for _ in submit(m.address("scheduler"), "late-1", [0, 7, 8], max_tokens=4):
                        pass
                with pytest.raises(grpc.aio.AioRpcError) as via_balancer:
                    await collect(s, gen_request([0, 7, 8], max_tokens=4))
                fresh = await fresh_sessions(m.address("scheduler"), 40)
                sched_stub = scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(m.address("scheduler")))
                load = await sched_stub.GetLoad(scheduler_pb2.GetLoadRequest())
                still_running = sched.poll() is None
            finally:
                worker.send_signal(signal.SIGCONT)
            msgs += [msg async for msg in call]
            return msgs, direct.value, via_balancer.value, still_running, load, fresh

        msgs, direct, via_balancer, still_running, load, fresh = asyncio.run(run())
        assert still_running, "the scheduler exited before the running stream finished"
        assert load.draining and load.running_requests == 1  # refused while the stream was still running
        assert direct.code() == grpc.StatusCode.UNAVAILABLE
        assert via_balancer.code() == grpc.StatusCode.UNAVAILABLE
        # a balancer that opens a session stream to the draining replica gets UNAVAILABLE for its request, so the
        # request moves: never grpc's INTERNAL of a stream ended while the submit was written (about 1 in 20)
        assert fresh == {"UNAVAILABLE": 40}, fresh
        assert msgs[-1].finished.reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(msg.token_ids) for msg in msgs) == 300
        assert sched.wait(timeout=20) == 0
        assert "Traceback" not in m.log("scheduler")
    finally:
        m.down()


def test_readiness_follows_the_replicas_and_liveness_does_not(model_dir: Path, tmp_path: Path) -> None:
    """The balancer's gRPC health and HTTP /health, /ready say NOT_SERVING / 503 while no replica can serve, and
    SERVING again once one can; /live stays 200 (a liveness probe must not restart a balancer for its replicas)."""
    try:
        import httpx2 as httpx  # what the openai client brings (older releases: httpx)
    except ImportError:
        import httpx

    from serving.mesh import health_status, wait_serving

    m = Mesh(model_dir, tmp_path, extra_env={"DEEPINFER_REPLICA_PROBE_S": "0.1"}).up()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    def wait_health(want: int) -> None:
        deadline = time.monotonic() + 60
        while health_status(m.address("balancer")) != want:
            assert time.monotonic() < deadline, f"the balancer's health never became {want}"
            time.sleep(0.05)

    try:
        sched = m.procs["scheduler"]
        args = list(sched.args[2:])
        assert httpx.get(f"{m.http_url()}/health").status_code == 200
        sched.kill()
        sched.wait()
        wait_health(not_serving)
        codes = {p: httpx.get(f"{m.http_url()}{p}").status_code for p in ("/health", "/ready", "/live")}
        assert codes == {"/health": 503, "/ready": 503, "/live": 200}

        async def one(**sampling):  # the channel opens in the loop that uses it
            return await collect(stub(m), gen_request([0, 7, 8], **sampling))

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(one(max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        m.start("scheduler", args)  # the same replica back on its port
        wait_serving(m.address("scheduler"), proc=m.procs["scheduler"])
        wait_health(serving)
        assert httpx.get(f"{m.http_url()}/ready").status_code == 200
        _, toks, _ = asyncio.run(one(max_tokens=4, ignore_eos=True))
        assert len(toks) == 4
    finally:
        m.down()
