"""One ``Scheduler.Session`` stream: many requests over one stream, their events out in one message per step.

The balancer holds one such stream per replica instead of a ``Submit`` call per request: with a call per request,
every engine step costs a message, a write and a task switch per running request on both ends (at 64 requests
2.4-2.8 ms of CPU a step on this side and 2.0-2.4 on the balancer's, on a 2-core host: ``bench/serving/fanout.py``);
over a session it costs one message (0.44 ms here). Each request
behaves as it would as its own ``Submit`` call: the service admits it, its events arrive through a :class:`Sink` in
the order the engine loop delivers them, its last event (or error status) closes it, and a request whose caller
cancels it, or whose stream ends, is aborted as a cancelled call is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.serving.server import status_for
from deepinfer.serving.tracing import RequestTrace, extract_metadata
from deepinfer.v1 import scheduler_pb2

Item = scheduler_pb2.TokenEvent | BaseException


class Sink(Protocol):
    """Where the engine loop puts a request's events (an ``asyncio.Queue`` for a ``Submit`` call)."""

    def put_nowait(self, item: Item) -> None: ...


class Streams(Protocol):
    """What a session needs of the scheduler service (``SchedulerService``: ``open``, ``last``, ``close``)."""

    async def open(
        self, request: scheduler_pb2.SubmitRequest, parent: object, sink: Sink
    ) -> tuple[RequestTrace, MultiModalInput | None]: ...

    def last(self, ev: Item, trace_: RequestTrace) -> tuple[bool, str] | None: ...

    def close(
        self, rid: str, prompt_len: int, trace_: RequestTrace, mm: MultiModalInput | None, finished: bool, outcome: str
    ) -> None: ...


@dataclass
class _Open:
    prompt_len: int
    trace: RequestTrace
    mm: MultiModalInput | None


class _SessionSink:
    def __init__(self, session: SchedulerSession, rid: str) -> None:
        self.session, self.rid = session, rid

    def put_nowait(self, item: Item) -> None:
        self.session.push(self.rid, item)


def status_item(rid: str, exc: BaseException) -> scheduler_pb2.SessionItem:
    code, message = status_for(exc)
    return scheduler_pb2.SessionItem(
        status=scheduler_pb2.RequestStatus(request_id=rid, code=code.value[0], message=message)
    )


class SchedulerSession:
    def __init__(self, service: Streams) -> None:
        self.service = service
        self.open: dict[str, _Open] = {}
        self.preparing: set[str] = set()  # submitted, being admitted (a request with images: the worker prepares them)
        self.cancelled: set[str] = set()  # cancelled while being admitted
        self.items: list[scheduler_pb2.SessionItem] = []  # to send with the next message
        self.ready = asyncio.Event()
        self.reading = True
        self.closing = False
        self.refused: str | None = None  # the caller broke the protocol: the stream ends with INVALID_ARGUMENT
        self._tasks: set[asyncio.Task] = set()

    async def read(self, requests: AsyncIterator[scheduler_pb2.SessionRequest]) -> None:
        """Take the caller's submits and cancels until it ends its side of the stream."""
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "submit" and msg.submit.request.images:  # the worker prepares them: the rest go on
                    task = asyncio.ensure_future(self.submit(msg.submit))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif kind == "submit":
                    await self.submit(msg.submit)
                elif kind == "cancel":
                    self.cancel(msg.cancel)
                else:  # a caller that speaks another protocol: its requests cannot be trusted to mean anything
                    self.refused = "SessionRequest: neither submit nor cancel"
                    break
        finally:
            self.reading = False
            self.ready.set()

    async def submit(self, sub: scheduler_pb2.SessionSubmit) -> None:
        rid = sub.request.request_id
        if rid in self.open or rid in self.preparing:
            self._send(status_item(rid, ValueError(f"request_id: {rid!r} is already running on this stream")))
            return
        self.preparing.add(rid)
        try:
            trace_, mm = await self.service.open(sub.request, extract_metadata(sub.trace_context.items()),
                                                 _SessionSink(self, rid))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            self._send(status_item(rid, e))
            return
        finally:
            self.preparing.discard(rid)
        self.open[rid] = _Open(len(sub.request.prompt_token_ids), trace_, mm)
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            self._close(rid, False, "aborted")

    def cancel(self, rid: str) -> None:
        """The caller of ``rid`` is gone (a request not of this stream, or over, is left alone)."""
        if rid in self.preparing:
            self.cancelled.add(rid)
        elif rid in self.open:
            self._close(rid, False, "aborted")

    def push(self, rid: str, item: Item) -> None:
        """An event (or the error that ends it) of one of the stream's requests, from the engine loop."""
        entry = self.open.get(rid)
        if entry is None:
            return
        last = self.service.last(item, entry.trace)
        if isinstance(item, BaseException):
            self._send(status_item(rid, item))
        else:
            self._send(scheduler_pb2.SessionItem(event=item))
        if last is not None:
            self._close(rid, *last)

    def _send(self, item: scheduler_pb2.SessionItem) -> None:
        self.items.append(item)
        self.ready.set()

    def _close(self, rid: str, finished: bool, outcome: str) -> None:
        entry = self.open.pop(rid)
        self.service.close(rid, entry.prompt_len, entry.trace, entry.mm, finished, outcome)

    async def batches(self) -> AsyncIterator[scheduler_pb2.SessionEvents]:
        """The stream's messages: what was delivered since the last one, until no request of the stream is open and
        the caller ended its side or the service is closing (:meth:`end`)."""
        while True:
            if self.refused is not None:
                return
            if self.items:
                items, self.items = self.items, []
                yield scheduler_pb2.SessionEvents(items=items)
                continue
            if (not self.reading or self.closing) and not self.open and not self.preparing:
                return
            await self.ready.wait()
            self.ready.clear()

    def end(self) -> None:
        """The service is closing (drained): the stream ends once what it holds is sent and nothing is open on it."""
        self.closing = True
        self.ready.set()

    def close(self) -> None:
        """The stream is over: every request still open on it is aborted."""
        for task in list(self._tasks):
            task.cancel()
        for rid in list(self.open):
            self._close(rid, False, "aborted")
