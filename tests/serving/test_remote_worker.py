"""The scheduler's end of its worker's step stream against grpc peers standing in for a worker: one that takes steps
and never answers (``services.scheduler.remote_worker``: a broken stream is a lost worker, a stopping service's
cancellation is not), and one that answers out of protocol (a real scheduler process fails its requests and ends)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from deepinfer.engine.interfaces import WorkerStepPlan
from deepinfer.serving.healthcheck import free_port, wait_serving
from deepinfer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.scheduler.remote_worker import RemoteWorker, WorkerLost
from serving.mesh import ROOT

pytestmark = pytest.mark.timeout(60)


class SilentWorker(worker_pb2_grpc.WorkerServicer):
    """Reads every step and answers none (a worker busy on a long step)."""

    async def Step(self, requests, context):  # noqa: N802
        async for _ in requests:
            pass
        await asyncio.Event().wait()
        yield  # pragma: no cover - never reached: the method is a stream


async def _blocked_receive() -> tuple[grpc.aio.Server, RemoteWorker, asyncio.Task]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(SilentWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = RemoteWorker(f"127.0.0.1:{port}")
    await worker.send(WorkerStepPlan(step_id=1))
    task = asyncio.ensure_future(worker.receive())
    await asyncio.sleep(0.2)
    assert not task.done()  # waiting for the step's result
    return server, worker, task


def test_a_stream_cancelled_under_the_client_is_a_lost_worker() -> None:
    async def run() -> None:
        server, worker, task = await _blocked_receive()
        try:
            await worker.channel.close()  # its calls are cancelled
            with pytest.raises(WorkerLost, match="cancelled"):
                await task
        finally:
            await worker.close()
            await server.stop(None)

    asyncio.run(run())


def test_the_stopping_services_cancellation_is_not_taken_for_a_lost_worker() -> None:
    """The scheduler stopping cancels its engine loop and closes the worker's channel; when the stream's end is seen
    first, the task's own cancellation must still go on (else the loop dials the closed channel and dies)."""

    async def run() -> None:
        server, worker, task = await _blocked_receive()
        try:
            task.cancel()
            worker.lost.set()  # the stream's done callback ran before the task resumed (the order that failed)
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await worker.close()
            await server.stop(None)

    asyncio.run(run())


class OutOfProtocolWorker(worker_pb2_grpc.WorkerServicer):
    """Says what it serves, then answers every step with a step id that was never sent (a faulty or hostile peer)."""

    async def GetWorkerInfo(self, request, context):  # noqa: N802
        return worker_pb2.WorkerInfo(worker_id="w-1", accelerator="cpu", device="cpu", model="m", num_pages=64,
                                     page_size=64, max_model_len=512, vocab_size=1000, eos_token_id=1,
                                     dtype="float32", fingerprint="f", world_size=1)  # fmt: skip

    async def Step(self, requests, context):  # noqa: N802
        async for plan in requests:
            yield worker_pb2.StepResult(step_id=plan.step_id + 1000)


def test_a_worker_out_of_protocol_fails_the_requests_and_ends_the_scheduler(tmp_path: Path) -> None:
    """The scheduler's engine loop cannot go on past such an answer: its request fails with UNAVAILABLE at once (the
    balancer moves it elsewhere) and the process ends, for its supervisor to start a fresh one — before, the loop's
    task died silently and the replica stayed up, serving nothing."""

    async def run() -> tuple[grpc.StatusCode, str, int, str]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(OutOfProtocolWorker(), server)
        worker_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port, log = free_port("127.0.0.1"), tmp_path / "scheduler.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "libs"), str(ROOT)]), PYTHONUNBUFFERED="1")
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "services.scheduler", "--worker", f"127.0.0.1:{worker_port}",
                                     "--port", str(port), "--grace", "5"], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
        try:
            await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", 60.0, proc, log)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = scheduler_pb2_grpc.SchedulerStub(ch).Submit(
                    scheduler_pb2.SubmitRequest(
                        request_id="r-1", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=4)
                    )
                )
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in call:
                        pass
            code = await asyncio.to_thread(proc.wait, 60)
            return failed.value.code(), failed.value.details(), code, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            await server.stop(None)

    code, details, exit_code, log = asyncio.run(run())
    assert code == grpc.StatusCode.UNAVAILABLE and "engine loop failed" in details, (code, details)
    assert exit_code == 1, log[-3000:]  # (ended for a fault, after a drain with nothing left to run)
    assert "engine_loop_failed" in log and "answered where step" in log
