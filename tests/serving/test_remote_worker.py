"""The scheduler's client of its worker's step stream (``services.scheduler.remote_worker``) against a grpc peer that
takes steps and never answers: a broken stream is a lost worker, a stopping service's cancellation is not."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from deepinfer.engine.interfaces import WorkerStepPlan
from deepinfer.v1 import worker_pb2_grpc
from services.scheduler.remote_worker import RemoteWorker, WorkerLost

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
