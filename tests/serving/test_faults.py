"""What production does to a mesh, done to ``deepinfer up``'s mesh (the launcher: NATS, kvstore, grammar, two
replicas, the balancer, supervised) with real processes and real clients: idle past many keepalive periods,
kill -9 of a worker and of a scheduler under streams, both workers at once, and SIGTERM with long streams.
The outcome asserted is the user's: every stream completes, token for token equal to an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.launcher import Mesh
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.launched import launched_mesh

pytestmark = pytest.mark.timeout(600)
PROMPTS = [[0, 11 + i, 40 + 3 * i, 7] for i in range(8)]
MAX_TOKENS = 32  # (the kills come once every stream has 3: 29 tokens or more move)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("faults")
    env = dict(
        DEEPINFER_BATCH_INVARIANT="1",  # a moved request's logits are bit-identical to the undisturbed run's
        DEEPINFER_LOG_LEVEL="info",
        DEEPINFER_GRPC_KEEPALIVE_S="0.2",  # short timers instead of long waits
        DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S="2",
        DEEPINFER_REPLICA_PROBE_S="0.2",
        DEEPINFER_RESTART_MAX_BACKOFF_S="1",
        DEEPINFER_DRAIN_GRACE_S="60",
    )
    with launched_mesh(tmp, make_tiny_model(tmp / "model", seed=3), supervise=True, grammar=True, **env) as m:
        yield m


def request(ids: list[int], seeded: bool) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8 if seeded else 0.0)
    if seeded:
        sampling.seed = 1234
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling)


async def stream(stub, req, started: asyncio.Event | None = None, after: int = 3) -> tuple[list[int], int]:
    """The stream's token ids and its finish reason; ``started`` is set once ``after`` tokens arrived."""
    tokens, reason = [], None
    async for msg in stub.Generate(req, timeout=300):
        tokens += msg.token_ids
        if started is not None and len(tokens) >= after:
            started.set()
        if msg.HasField("finished"):
            reason = msg.finished.reason
    return tokens, reason


async def run_all(address: str, kill=None) -> list[tuple[list[int], int]]:
    """Every prompt greedy and seeded at once; ``kill()`` runs once every stream has tokens."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        reqs = [request(p, seeded) for p in PROMPTS for seeded in (False, True)]
        events = [asyncio.Event() for _ in reqs]
        tasks = [asyncio.create_task(stream(stub, r, e)) for r, e in zip(reqs, events)]
        if kill is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=120)
            kill()
        return await asyncio.gather(*tasks)


@pytest.fixture(scope="module")
def reference(mesh: Mesh) -> list[tuple[list[int], int]]:
    out = asyncio.run(run_all(mesh.endpoints["grpc"]))
    assert all(len(t) == MAX_TOKENS and r == common_pb2.FINISH_REASON_LENGTH for t, r in out)
    return out


def pid(mesh: Mesh, name: str) -> int:
    return dict(mesh.procs)[name].pid


def test_an_idle_mesh_serves_after_many_keepalive_periods(mesh: Mesh, reference) -> None:
    # keepalive pings every 0.2 s: a server refusing them (GOAWAY too_many_pings) would cut every channel within
    # three pings; 4 s idle is twenty
    time.sleep(4)
    assert asyncio.run(run_all(mesh.endpoints["grpc"])) == reference
    assert "too_many_pings" not in "".join((mesh.log_dir / f"{n}.log").read_text() for n, _ in mesh.procs)


def test_kill9_of_a_worker_under_streams_loses_nothing(mesh: Mesh, reference) -> None:
    before = len(mesh.restarts.get("worker-0", []))
    out = asyncio.run(run_all(mesh.endpoints["grpc"], kill=lambda: os.kill(pid(mesh, "worker-0"), signal.SIGKILL)))
    assert out == reference
    wait_restarted(mesh, "worker-0", before)
    assert "request_moving" in (mesh.log_dir / "balancer.log").read_text()  # the streams did move


def test_kill9_of_a_scheduler_under_streams_loses_nothing(mesh: Mesh, reference) -> None:
    before = len(mesh.restarts.get("scheduler-1", []))
    out = asyncio.run(run_all(mesh.endpoints["grpc"], kill=lambda: os.kill(pid(mesh, "scheduler-1"), signal.SIGKILL)))
    assert out == reference
    wait_restarted(mesh, "scheduler-1", before)


def test_both_workers_killed_streams_wait_for_the_restarted_ones(mesh: Mesh, reference) -> None:
    def kill_both() -> None:
        for name in ("worker-0", "worker-1"):
            os.kill(pid(mesh, name), signal.SIGKILL)

    assert asyncio.run(run_all(mesh.endpoints["grpc"], kill=kill_both)) == reference


def wait_restarted(mesh: Mesh, name: str, before: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(mesh.restarts.get(name, [])) <= before:
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.1)


def test_every_service_exports_metrics_on_a_printed_port(mesh: Mesh) -> None:
    found = {name.removesuffix(" metrics"): url for name, url in mesh.endpoints.items() if name.endswith(" metrics")}
    assert set(found) == {"kvstore", "grammar", "worker-0", "worker-1", "scheduler-0", "scheduler-1"}
    bodies = {name: urllib.request.urlopen(url, timeout=10).read().decode() for name, url in found.items()}
    assert "vllm:num_requests_running" in bodies["scheduler-0"]
    assert "deepinfer_scheduler_worker_lost_total" in bodies["scheduler-0"]
    assert all("# TYPE" in body for body in bodies.values())


def test_each_scheduler_reaches_its_worker_through_a_private_unix_socket(mesh: Mesh) -> None:
    """The launcher gives each replica's worker a Unix socket in a directory of its own user's (0700), the socket
    0600; its scheduler dials it. (The kill -9 tests above restart workers on the same path: a stale socket is
    replaced.)"""
    for r in (0, 1):
        worker_args, scheduler_args = mesh.specs[f"worker-{r}"][0], mesh.specs[f"scheduler-{r}"][0]
        path = Path(worker_args[worker_args.index("--unix-socket") + 1])
        assert scheduler_args[scheduler_args.index("--worker") + 1] == f"unix:{path}"
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_sigterm_drains_long_streams_in_order(mesh: Mesh, reference) -> None:
    """Last: it stops the mesh. The balancer stops admitting, the streams it has finish, then the rest stops (and
    the workers' socket directory goes)."""
    sockets = mesh._socket_dir()
    assert sockets is not None and sockets.is_dir()
    stopper = threading.Thread(target=mesh.stop)

    async def run() -> tuple[list, grpc.StatusCode | None]:
        results = asyncio.create_task(run_all(mesh.endpoints["grpc"], kill=stopper.start))
        async with grpc.aio.insecure_channel(mesh.endpoints["grpc"]) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while not stopper.is_alive() and not results.done():  # the streams run, the drain has begun ...
                await asyncio.sleep(0.02)
            while (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status == health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            late = None
            try:  # ... so a new request is refused while they finish
                await stream(generation_pb2_grpc.GenerationStub(ch), request([0, 5, 6], False))
            except grpc.aio.AioRpcError as e:
                late = e.code()
        out = await results
        await asyncio.to_thread(stopper.join, 120)
        return out, late

    out, late = asyncio.run(run())
    assert out == reference
    assert late == grpc.StatusCode.UNAVAILABLE
    assert not sockets.exists()
