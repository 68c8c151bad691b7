"""The scheduler's ``Session`` stream (many requests over one stream, each step's events in one message) and the
balancer's client of it (``services.balancer.session_client``), through real processes on loopback with grpcio
clients: each request of a session behaves as its own ``Submit`` call would."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.balancer.replicas import Replica
from services.balancer.session_client import SessionClient
from serving.launched import metric
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)
UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
LONG = dict(temperature=0, max_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("session_model"), seed=5)


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    m = Mesh(model_dir, tmp_path_factory.mktemp("session_logs")).up(http=False)
    yield m
    m.down()


def request(rid: str, ids: list[int], **sampling) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids,
                                       sampling=common_pb2.SamplingParams(**sampling))  # fmt: skip


def scheduler(mesh: Mesh) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(mesh.address("scheduler")))


class Stream:
    """A raw Session stream: what goes in, and each message that comes out."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = stub.Session(self._requests())
        self.messages: list[scheduler_pb2.SessionEvents] = []

    async def _requests(self):
        while (msg := await self.outbox.get()) is not None:
            yield msg

    def submit(self, req: scheduler_pb2.SubmitRequest) -> None:
        self.outbox.put_nowait(scheduler_pb2.SessionRequest(submit=scheduler_pb2.SessionSubmit(request=req)))

    def cancel(self, rid: str) -> None:
        self.outbox.put_nowait(scheduler_pb2.SessionRequest(cancel=rid))

    async def until(self, done) -> None:
        """Read messages until ``done(self)``."""
        while not done(self):
            msg = await self.call.read()
            assert msg is not grpc.aio.EOF, "the session stream ended"
            self.messages.append(msg)

    def events(self, rid: str) -> list[scheduler_pb2.TokenEvent]:
        return [i.event for m in self.messages for i in m.items if i.HasField("event") and i.event.request_id == rid]

    def status(self, rid: str) -> scheduler_pb2.RequestStatus | None:
        found = [i.status for m in self.messages for i in m.items
                 if i.HasField("status") and i.status.request_id == rid]  # fmt: skip
        return found[0] if found else None

    def over(self, rid: str) -> bool:
        evs = self.events(rid)
        return self.status(rid) is not None or bool(evs and evs[-1].finish_reason != UNSPECIFIED)


async def submit_call(stub: scheduler_pb2_grpc.SchedulerStub, req: scheduler_pb2.SubmitRequest):
    return [ev async for ev in stub.Submit(req, timeout=120)]


async def wait_idle(stub: scheduler_pb2_grpc.SchedulerStub) -> common_pb2.ReplicaLoad:
    for _ in range(100):
        load = await stub.GetLoad(scheduler_pb2.GetLoadRequest())
        if load.running_requests == 0 and load.waiting_requests == 0 and load.free_kv_pages == load.total_kv_pages:
            break
        await asyncio.sleep(0.1)
    return load


def tokens(events) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def test_session_requests_match_their_submit_calls(mesh: Mesh) -> None:
    reqs = [request(f"r{i}", [0, 10 + i, 20 + 2 * i, 30], temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=6 + i)
            for i in range(6)]  # fmt: skip

    async def run():
        stub = scheduler(mesh)
        alone = [await submit_call(stub, r) for r in reqs]
        s = Stream(stub)
        for r in reqs:
            s.submit(r)
        await s.until(lambda s: all(s.over(r.request_id) for r in reqs))
        s.outbox.put_nowait(None)  # the caller's side ends; no request is open: so does the stream
        assert await s.call.read() is grpc.aio.EOF
        return alone, s, await wait_idle(stub)

    alone, s, load = asyncio.run(run())
    for r, evs in zip(reqs, alone):
        together = s.events(r.request_id)
        assert tokens(together) == tokens(evs) and len(tokens(evs)) == r.sampling.max_tokens
        assert together[-1].finish_reason == evs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert s.status(r.request_id) is None
    # decode steps of several requests came as one message each
    assert max(len({i.event.request_id for i in m.items}) for m in s.messages) > 1
    assert load.free_kv_pages == load.total_kv_pages


def test_errors_and_cancels_touch_only_their_request(mesh: Mesh) -> None:
    async def run():
        stub = scheduler(mesh)
        s = Stream(stub)
        s.submit(request("long", [0, 7, 8], **LONG))
        await s.until(lambda s: s.events("long"))  # running
        s.submit(request("long", [0, 7, 8], **LONG))  # the same id again on this stream
        s.submit(request("bad", [0, 10**6], temperature=0, max_tokens=4))
        s.submit(request("bad-sampling", [0, 5], temperature=-1.0, max_tokens=4))
        s.submit(request("ok", [0, 3, 4], temperature=0, max_tokens=5))
        await s.until(lambda s: s.over("ok") and s.status("bad") and s.status("bad-sampling"))
        dup = s.status("long")
        before = len(s.events("long"))
        s.cancel("long")
        load = await wait_idle(stub)
        s.submit(request("after", [0, 3, 4], temperature=0, max_tokens=5))  # the stream goes on
        await s.until(lambda s: s.over("after"))
        s.call.cancel()
        return s, dup, before, load

    s, dup, before, load = asyncio.run(run())
    assert dup.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already running" in dup.message
    bad = s.status("bad")
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "prompt_token_ids" in bad.message
    assert s.status("bad-sampling").code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in s.status("bad-sampling").message
    assert len(tokens(s.events("ok"))) == 5 and len(tokens(s.events("after"))) == 5
    # the cancelled request's pages are free, and it sent nothing after the cancel was read
    assert load.running_requests == 0 and load.free_kv_pages == load.total_kv_pages
    assert all(ev.finish_reason == UNSPECIFIED for ev in s.events("long")[before:])


def test_a_session_that_ends_aborts_its_requests(mesh: Mesh) -> None:
    async def run():
        stub = scheduler(mesh)
        s = Stream(stub)
        for i in range(3):
            s.submit(request(f"gone{i}", [0, 40 + i], **LONG))
        await s.until(lambda s: all(s.events(f"gone{i}") for i in range(3)))
        busy = await stub.GetLoad(scheduler_pb2.GetLoadRequest())
        s.call.cancel()  # the balancer went away
        return busy, await wait_idle(stub)

    busy, load = asyncio.run(run())
    assert busy.running_requests == 3
    assert load.running_requests == 0 and load.free_kv_pages == load.total_kv_pages


def test_session_client_calls_act_as_submit_calls(mesh: Mesh) -> None:
    """The balancer's client: events as a Submit call gives them, a status raised as the call's error, DEADLINE_EXCEEDED
    past a timeout (the replica aborts the request), cancel() frees the pages."""

    async def run():
        stub = scheduler(mesh)
        client = SessionClient(stub, mesh.address("scheduler"))
        ref = await submit_call(stub, request("ref", [0, 9, 9, 9], temperature=0, max_tokens=7))
        got = [ev async for ev in client.submit(request("a", [0, 9, 9, 9], temperature=0, max_tokens=7))]
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _ in client.submit(request("b", [0, 10**6], temperature=0, max_tokens=3)):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for _ in client.submit(request("c", [0, 1, 2], **LONG), timeout=0.5):
                pass
        load_late = await wait_idle(stub)
        cancelled = client.submit(request("d", [0, 1, 2], **LONG))
        async for _ in cancelled:
            break
        cancelled.cancel()
        load_cancel = await wait_idle(stub)
        open_after = client.open_requests
        await client.close()
        return ref, got, bad.value, late.value, load_late, load_cancel, open_after

    ref, got, bad, late, load_late, load_cancel, open_after = asyncio.run(run())
    assert tokens(got) == tokens(ref) and got[-1].finish_reason == ref[-1].finish_reason
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in bad.details()
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for load in (load_late, load_cancel):
        assert load.running_requests == 0 and load.free_kv_pages == load.total_kv_pages
    assert open_after == 0


def test_the_balancer_sends_requests_over_one_session_per_replica(mesh: Mesh) -> None:
    async def run():
        s = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(mesh.address("balancer")))
        reqs = [generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[0, 60 + i]),
                                               sampling=common_pb2.SamplingParams(temperature=0, max_tokens=5))
                for i in range(8)]  # fmt: skip
        outs = await asyncio.gather(*[_collect(s, r) for r in reqs])
        return outs

    outs = asyncio.run(run())
    assert all(len(t) == 5 for t in outs)
    for _ in range(100):  # (the streams of earlier tests, cancelled by their clients, close on the server meanwhile)
        streams = metric(mesh.metrics_url("scheduler"), "deepinfer_scheduler_session_streams")
        if streams == 1:
            break
        time.sleep(0.05)
    assert streams == 1


async def _collect(s, req) -> list[int]:
    return [t async for m in s.Generate(req, timeout=120) for t in m.token_ids]


class _SubmitOnly(scheduler_pb2_grpc.SchedulerServicer):
    """A replica from before Session streams: Submit calls only (Session answers UNIMPLEMENTED)."""

    async def Submit(self, request, context):  # noqa: N802
        yield scheduler_pb2.TokenEvent(request_id=request.request_id, token_ids=[1],
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)  # fmt: skip


async def _submit_only_replica(calls: int) -> tuple[list, bool]:
    """``calls`` one-token requests through a ``Replica`` (with a session client) of a Submit-only scheduler: each
    call's events or its error, and whether the client marked the replica as taking no Session stream."""
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(_SubmitOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    replica = Replica.connect(f"127.0.0.1:{port}")
    replica.session = SessionClient(replica.stub, replica.address)
    out = []
    try:
        for i in range(calls):
            try:
                events = replica.submit(request(f"r{i}", [0, 1], max_tokens=1), 10, [])
                out.append([ev.token_ids async for ev in events])
            except grpc.aio.AioRpcError as e:
                out.append(e.code())
        return out, replica.session.unsupported
    finally:
        await replica.close()
        await server.stop(None)


def test_a_replica_without_sessions_gets_submit_calls() -> None:
    """The requests sent while the client learns that the replica takes no Session stream move (UNAVAILABLE); later
    ones go to it as Submit calls."""
    out, unsupported = asyncio.run(_submit_only_replica(2))
    assert out == [grpc.StatusCode.UNAVAILABLE, [[1]]] and unsupported


def test_replica_sessions_off_sends_submit_calls_from_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DEEPINFER_REPLICA_SESSIONS=0``: the balancer sends each request as a Submit call of its own, so even the
    first request reaches a Submit-only replica (the client never tries, nor learns about, a Session stream)."""
    monkeypatch.setenv("DEEPINFER_REPLICA_SESSIONS", "0")
    out, unsupported = asyncio.run(_submit_only_replica(2))
    assert out == [[[1]], [[1]]] and not unsupported


def test_a_caller_behind_takes_the_waiting_events_as_one(mesh: Mesh) -> None:
    """Events that wait for a slow caller come as one: the same tokens, logprobs and finish as the Submit call's."""

    async def run():
        stub = scheduler(mesh)
        req = dict(temperature=0, max_tokens=10, logprobs=1)
        ref = await submit_call(stub, request("ref", [0, 8, 6, 4], **req))
        client = SessionClient(stub, mesh.address("scheduler"))
        call = client.submit(request("slow", [0, 8, 6, 4], **req))
        for _ in range(600):  # every event read off the stream before the caller reads any
            if call.items.qsize() == 10:  # (one event a token, the last one finishing)
                break
            await asyncio.sleep(0.05)
        got = [ev async for ev in call]
        await client.close()
        return ref, got

    ref, got = asyncio.run(run())
    assert len(ref) > 1 and len(got) == 1
    assert tokens(got) == tokens(ref) and got[0].finish_reason == ref[-1].finish_reason
    assert [lp.token_id for lp in got[0].logprobs] == tokens(ref)
    assert [lp.logprob for lp in got[0].logprobs] == [lp.logprob for ev in ref for lp in ev.logprobs]


def test_merge_keeps_every_field_of_both_events() -> None:
    from services.balancer.session_client import merge

    handled = {"request_id", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "stop_token_id",
               "cached_tokens", "cached_tier", "prompt_tokens", "draft_tokens", "accepted_draft_tokens",
               "handoff"}  # fmt: skip
    assert {f.name for f in scheduler_pb2.TokenEvent.DESCRIPTOR.fields} == handled  # a new field: teach merge it
    a = scheduler_pb2.TokenEvent(request_id="r", prompt_logprobs=[scheduler_pb2.PromptLogprobEntry(position=1)],
                                 prompt_tokens=5, token_ids=[3], draft_tokens=2, accepted_draft_tokens=1)  # fmt: skip
    b = scheduler_pb2.TokenEvent(request_id="r", token_ids=[4, 5], draft_tokens=4, accepted_draft_tokens=3,
                                 finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=5, cached_tokens=2,
                                 cached_tier="device")  # fmt: skip
    m = merge(a, b)
    assert list(m.token_ids) == [3, 4, 5] and [r.position for r in m.prompt_logprobs] == [1]
    assert (m.prompt_tokens, m.draft_tokens, m.accepted_draft_tokens) == (5, 4, 3)
    assert (m.finish_reason, m.stop_token_id, m.cached_tokens, m.cached_tier) == (common_pb2.FINISH_REASON_STOP, 5,
                                                                                 2, "device")  # fmt: skip


def test_a_message_that_is_neither_submit_nor_cancel_ends_the_stream(mesh: Mesh) -> None:
    """A caller that breaks the protocol gets INVALID_ARGUMENT for its stream (its requests aborted); the replica
    serves on."""

    async def run():
        stub = scheduler(mesh)
        s = Stream(stub)
        s.submit(request("doomed", [0, 50], **LONG))
        await s.until(lambda s: s.events("doomed"))
        s.outbox.put_nowait(scheduler_pb2.SessionRequest())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.until(lambda s: False)
        load = await wait_idle(stub)
        after = await submit_call(stub, request("after-bad", [0, 3], temperature=0, max_tokens=3))
        return e.value, load, after

    err, load, after = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "SessionRequest" in err.details()
    assert load.running_requests == 0 and load.free_kv_pages == load.total_kv_pages
    assert len(tokens(after)) == 3
