"""The scheduler's end of its worker: one ``Worker.Step`` stream, re-opened after it breaks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.rpc.channel import open_channel
from deepinfer.rpc.convert import plan_to_proto, result_from_proto
from deepinfer.v1 import worker_pb2, worker_pb2_grpc

PREPARE_TIMEOUT_S = 300.0  # encoding a request's images on the worker


class WorkerLost(Exception):
    """The step stream to the worker broke: the worker holds none of this replica's state any more."""


class RemoteWorker:
    """The client end of one ``Worker.Step`` stream; steps are answered in order. After the stream breaks,
    :meth:`reset` forgets it and the next :meth:`send` opens a new one (the channel reconnects by itself)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = open_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.lost = asyncio.Event()  # set when the open step stream ends for any reason
        self._outbox: asyncio.Queue[worker_pb2.StepPlan | None] = asyncio.Queue()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._sent: set[str] = set()
        self._image_drops: list[str] = []  # requests whose prepared images go with the next step (dropped_images)

    async def info(self, timeout: float = 60.0) -> worker_pb2.WorkerInfo:
        return await self.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), wait_for_ready=True, timeout=timeout)

    async def prepare_images(
        self, request_id: str, token_ids: list[int], images: list[bytes]
    ) -> tuple[list[int], MultiModalInput]:
        """Have the worker encode a request's images (the features stay there) and expand its placeholders: the
        expanded ids and the spans and digests the scheduler plans with (``data`` is None on this side)."""
        msg = worker_pb2.PrepareImagesRequest(request_id=request_id, token_ids=token_ids, images=images)
        out = await self.stub.PrepareImages(msg, timeout=PREPARE_TIMEOUT_S)
        spans = tuple(zip(out.spans[0::2], out.spans[1::2]))
        return list(out.token_ids), MultiModalInput(spans, tuple(out.digests), None)

    @property
    def has_image_drops(self) -> bool:
        """Dropped images wait for a step to carry them."""
        return bool(self._image_drops)

    def drop_images(self, request_id: str) -> None:
        """The request is over: its prepared images are dropped with the next step (after every earlier one)."""
        self._image_drops.append(request_id)

    async def _plans(self, outbox: asyncio.Queue) -> AsyncIterator[worker_pb2.StepPlan]:
        while (msg := await outbox.get()) is not None:
            yield msg

    async def execute(self, plan: WorkerStepPlan) -> StepResult:
        await self.send(plan)
        return await self.receive()

    async def send(self, plan: WorkerStepPlan) -> None:
        """Queue a step; results come back in order through :meth:`receive`."""
        if self.lost.is_set():
            raise WorkerLost(f"worker {self.address}: the step stream ended")
        if self._call is None:
            self._call = self.stub.Step(self._plans(self._outbox))
            lost = self.lost  # this stream's event: a late callback of a forgotten stream must not set the next one's
            self._call.add_done_callback(lambda _: lost.set())
        msg = plan_to_proto(plan, self._sent)
        msg.dropped_images.extend(self._image_drops)
        self._image_drops.clear()
        await self._outbox.put(msg)

    async def receive(self) -> StepResult:
        if self._call is None:
            raise WorkerLost(f"worker {self.address}: no step was sent")
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            raise WorkerLost(f"worker {self.address}: {e.code().name}: {e.details()}") from e
        except asyncio.CancelledError:
            # the call was cancelled under us (``reset``, a closed channel): the stream is lost; but when this task
            # itself is being cancelled (the service stopping), that cancellation goes on, whatever else happened
            task = asyncio.current_task()
            if self.lost.is_set() and (task is None or not task.cancelling()):
                raise WorkerLost(f"worker {self.address}: the step stream was cancelled") from None
            raise
        if msg is grpc.aio.EOF:
            raise WorkerLost(f"worker {self.address} closed its step stream")
        return result_from_proto(msg)

    def waits_for_tokens(self, plan: WorkerStepPlan) -> bool:
        """Never: the worker service holds a structured-output step until its tokens are in (the runner contract's
        in-process rule, kept on the worker's side of the stream)."""
        return False

    def reset(self) -> None:
        """Forget the broken stream: the next step opens a new one, sending every request's parameters again."""
        if self._call is not None:
            self._call.cancel()
        self._outbox.put_nowait(None)
        self._outbox, self._call, self._sent = asyncio.Queue(), None, set()
        self.lost = asyncio.Event()

    async def close(self) -> None:
        await self._outbox.put(None)
        await self.channel.close()
