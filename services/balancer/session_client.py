"""The balancer's one ``Scheduler.Session`` stream per replica: its requests' submits and cancels go out on it, and
each engine step's events of all of them come back in one message (a ``Submit`` call per request costs a message, a
write and a task switch per request per step on both ends: ``bench/serving/fanout.py``).

:meth:`SessionClient.submit` gives a :class:`SessionCall` that is used as the request's ``Submit`` call would be:
iterate its events; it raises the ``grpc.aio.AioRpcError`` the call would have (the replica's status for the
request; DEADLINE_EXCEEDED past its timeout; UNAVAILABLE when the session stream breaks, so the request moves to
another replica as after a failed call); ``cancel()`` when its caller is gone. A broken stream is forgotten: the next
submit opens a new one. The replica never ends the stream itself with INTERNAL: that status is grpc's own, given
when the stream ended while a message was being written to it ("Internal error from Core": e.g. a draining replica
ends a new session stream at once, and a submit written then loses the race), so it counts as the stream breaking.

A caller that falls behind its request's events (the balancer's event loop busy with other streams) takes what
waits as one event (:func:`merge`): one message to its client instead of one per step, with no delay when it keeps
up — so the balancer's work per step shrinks as it falls behind instead of growing into a backlog.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from deepinfer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_CODES = {c.value[0]: c for c in grpc.StatusCode}
UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def is_last(ev: scheduler_pb2.TokenEvent) -> bool:
    return ev.finish_reason != UNSPECIFIED or ev.HasField("handoff")


def merge(ev: scheduler_pb2.TokenEvent, later: scheduler_pb2.TokenEvent) -> scheduler_pb2.TokenEvent:
    """``ev`` followed by ``later`` as one event (``ev`` updated): tokens, logprobs and prompt rows in order; the
    finish, the cache report, the prompt's count and the draft totals as the later one says them."""
    ev.token_ids.extend(later.token_ids)
    ev.logprobs.extend(later.logprobs)
    ev.prompt_logprobs.extend(later.prompt_logprobs)
    ev.finish_reason, ev.stop_token_id = later.finish_reason, later.stop_token_id
    if later.cached_tokens or later.cached_tier:
        ev.cached_tokens, ev.cached_tier = later.cached_tokens, later.cached_tier
    if later.prompt_tokens:
        ev.prompt_tokens = later.prompt_tokens
    if later.draft_tokens:
        ev.draft_tokens, ev.accepted_draft_tokens = later.draft_tokens, later.accepted_draft_tokens
    if later.HasField("handoff"):
        ev.handoff.CopyFrom(later.handoff)
    return ev


class SessionCall:
    """One request on a session stream (see the module's docstring)."""

    def __init__(self, client: SessionClient, rid: str, timeout: float | None) -> None:
        self.client, self.request_id = client, rid
        self.items: asyncio.Queue[scheduler_pb2.TokenEvent | grpc.aio.AioRpcError] = asyncio.Queue()
        self.over = False  # its last event or its error was taken, or it was cancelled
        self._held: grpc.aio.AioRpcError | None = None  # an error taken while merging, raised next
        self._timer = None
        if timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, timeout), self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.client.forget(self.request_id, self):
            self.client.send_cancel(self.request_id)
            self.items.put_nowait(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def __aiter__(self) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        return self

    async def __anext__(self) -> scheduler_pb2.TokenEvent:
        if self.over:
            raise StopAsyncIteration
        item, self._held = (self._held, None) if self._held is not None else (await self.items.get(), None)
        if isinstance(item, grpc.aio.AioRpcError):
            self._end()
            raise item
        while not is_last(item) and not self.items.empty():  # the caller is behind: what waits goes as one event
            nxt = self.items.get_nowait()
            if isinstance(nxt, grpc.aio.AioRpcError):
                self._held = nxt  # (raised by the next call, after the events before it)
                break
            item = merge(item, nxt)
        if is_last(item):
            self._end()
        return item

    def _end(self) -> None:
        self.over = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cancel(self) -> None:
        """The caller is gone: the replica aborts the request (nothing happens once its stream is over)."""
        if self.over:
            return
        self._end()
        if self.client.forget(self.request_id, self):
            self.client.send_cancel(self.request_id)


class SessionClient:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, address: str) -> None:
        self.stub, self.address = stub, address
        self._calls: dict[str, SessionCall] = {}
        self._outbox: asyncio.Queue[scheduler_pb2.SessionRequest | None] | None = None
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self.unsupported = False  # the replica answered UNIMPLEMENTED: an older one, for Submit calls only

    @property
    def open_requests(self) -> int:
        return len(self._calls)

    def submit(
        self, request: scheduler_pb2.SubmitRequest, timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> SessionCall:  # fmt: skip
        """Send ``request`` on the stream (opened now if none is); its events come through the call returned."""
        rid = request.request_id
        if rid in self._calls:
            raise ValueError(f"request_id: {rid!r} is already running on replica {self.address}")
        if self._stream is None:
            self._open()
        call = self._calls[rid] = SessionCall(self, rid, timeout)
        sub = scheduler_pb2.SessionSubmit(request=request, trace_context=dict(metadata))
        self._outbox.put_nowait(scheduler_pb2.SessionRequest(submit=sub))
        return call

    def forget(self, rid: str, call: SessionCall) -> bool:
        """Drop ``call`` from the stream's open requests; False when it was not open there."""
        if self._calls.get(rid) is not call:
            return False
        del self._calls[rid]
        return True

    def send_cancel(self, rid: str) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(scheduler_pb2.SessionRequest(cancel=rid))

    def _open(self) -> None:
        outbox: asyncio.Queue[scheduler_pb2.SessionRequest | None] = asyncio.Queue()
        self._calls = {}
        self._outbox, self._stream = outbox, self.stub.Session(_drain(outbox))
        self._reader = asyncio.ensure_future(self._read(self._stream, self._calls, outbox))

    async def _read(
        self, stream: grpc.aio.StreamStreamCall, calls: dict[str, SessionCall], outbox: asyncio.Queue
    ) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"replica {self.address} ended its session stream")
        try:
            async for msg in stream:
                for item in msg.items:
                    self._route(item, calls)
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # the requests move, and go as Submit calls from now on
                self.unsupported = True
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"replica {self.address} takes no session stream")
            elif e.code() == grpc.StatusCode.INTERNAL:  # (the module's docstring) the stream broke: its requests move
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"replica {self.address}'s session stream broke "
                                  f"({e.details()})")  # fmt: skip
        finally:
            outbox.put_nowait(None)  # grpc's task that writes the stream's messages ends (else it waits for good)
            if self._stream is stream:  # the next submit opens a new stream
                self._outbox, self._stream, self._reader = None, None, None
            for call in calls.values():
                call.items.put_nowait(error)
            calls.clear()

    @staticmethod
    def _route(item: scheduler_pb2.SessionItem, calls: dict[str, SessionCall]) -> None:
        if item.WhichOneof("kind") == "event":
            ev = item.event
            call = calls.get(ev.request_id)
            if call is not None:
                call.items.put_nowait(ev)
                if is_last(ev):
                    del calls[ev.request_id]
        else:
            st = item.status
            call = calls.pop(st.request_id, None)
            if call is not None:
                call.items.put_nowait(rpc_error(_CODES.get(st.code, grpc.StatusCode.UNKNOWN), st.message))

    async def close(self) -> None:
        """End the stream (the replica aborts what is still open on it)."""
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


async def _drain(outbox: asyncio.Queue) -> AsyncIterator[scheduler_pb2.SessionRequest]:
    while (msg := await outbox.get()) is not None:
        yield msg
