"""Prefill/decode disaggregation (docs/routing.md).

Through the launcher's mesh with one prefill and one decode replica (``deepinfer up --prefill-replicas 1
--decode-replicas 1``: NATS, the kvstore, the balancer; real processes): a request prefills on the prefill replica,
its state moves through the kvstore, and it decodes on the decode replica without recomputing its prompt. Its tokens
and logprobs are exactly those of the same request run whole on one replica, greedy and seeded. Bad handoff fields
are refused (INVALID_ARGUMENT) and the replica serves on.

Without processes: the roles of ``deepinfer up``'s replicas, the balancer's choice by role, and a scheduler without a
kvstore refusing a handoff."""

from __future__ import annotations

import asyncio
import random
import signal
import time
import urllib.request

import grpc
import pytest

from deepinfer import SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.cli import replica_roles
from deepinfer.engine.interfaces import ExportResult, SeqResult, StepResult
from deepinfer.engine.pages import PagePool
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.rpc.channel import open_channel
from deepinfer.serving.errors import Unavailable
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.balancer.replicas import Replica, ReplicaSet
from serving.launched import launched_mesh, metric

VOCAB = 129280


def test_the_replicas_roles() -> None:
    assert replica_roles(None, 0, 0) == ["mixed"]
    assert replica_roles(3, 0, 0) == ["mixed"] * 3
    assert replica_roles(None, 2, 1) == ["prefill", "prefill", "decode"]
    assert replica_roles(1, 1, 1) == ["prefill", "decode", "mixed"]
    for bad in [(None, 1, 0), (None, 0, 2), (0, 0, 0), (None, -1, 1)]:
        with pytest.raises(ValueError, match="replicas"):
            replica_roles(*bad)


def test_the_choice_by_role() -> None:
    pool = ReplicaSet()
    pool.replicas = [Replica("p", None, role="prefill"), Replica("d", None, role="decode", in_flight=3),
                     Replica("m", None, role="mixed")]  # fmt: skip
    assert pool.disaggregated()
    assert pool.pick(role="prefill").address == "p" and pool.pick(role="decode").address == "d"
    assert pool.pick().address == "m"  # a whole request: never to a prefill replica while another serves
    pool.replicas[1].healthy = False
    assert not pool.disaggregated()
    with pytest.raises(Unavailable, match="no decode replica"):
        pool.pick(role="decode")
    pool.replicas = pool.replicas[:1]
    assert pool.pick().address == "p"  # the only one serving takes whole requests


def test_a_replica_without_a_kvstore_refuses_a_handoff() -> None:
    config = SchedulerConfig(page_size=16, max_model_len=256, eos_token_id=1, fingerprint="fp")
    s = Scheduler(config, PagePool(32))
    for kw, field in [({"hand_off": True}, "hand_off"), ({"resume_position": 3}, "resume_position")]:
        with pytest.raises(ValueError, match=field):
            s.add("r", [5, 6, 7, 8], SamplingParams(max_tokens=4), **kw)
    assert not s.requests and not s.waiting


def test_a_handoffs_export_goes_in_a_step_of_its_own() -> None:
    """A prefill replica's scheduler (a kvstore behind it): once a handing-off request has its first token, the next
    plan holds its export and no chunks, although another prompt waits, so the worker can answer that step as soon
    as the put is done instead of after the next prompt's prefill; the step after it plans the prompt. The request
    ends (``handoff``) only when the export is reported."""
    config = SchedulerConfig(page_size=16, max_model_len=256, eos_token_id=1, fingerprint="fp", remote_store=True,
                             max_num_batched_tokens=64)  # fmt: skip
    s = Scheduler(config, PagePool(32))
    s.add("h", list(range(10, 42)), SamplingParams(max_tokens=8, ignore_eos=True), hand_off=True)
    first = s.schedule()
    assert [c.request_id for c in first.chunks] == ["h"]
    s.add("next", list(range(50, 90)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert not s.update(StepResult(first.step_id, [SeqResult("h", token_id=7)]))
    export = s.schedule()
    assert not export.chunks and [o.export for o in export.offloads] == [True]
    after = s.schedule()
    assert [c.request_id for c in after.chunks] == ["next"] and not after.offloads
    done = s.update(StepResult(export.step_id, exported=[ExportResult(export.offloads[0].snapshot_id, True, "")]))
    assert [r.request_id for r in done] == ["h"] and done[0].finish_reason == "handoff"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("disagg")
    env = dict(DEEPINFER_BATCH_INVARIANT="1", DEEPINFER_INTERNAL_TOKEN="test-internal-token",
               DEEPINFER_DRAIN_GRACE_S="2")  # fmt: skip
    model = make_tiny_model(tmp / "model", seed=8)
    with launched_mesh(tmp, model, http=True, roles=["prefill", "decode"], **env) as m:
        yield m


async def whole(address: str, rid: str, ids: list[int], sampling: common_pb2.SamplingParams) -> tuple[list, list]:
    """The request run whole on one replica (its scheduler, no handoff): tokens and logprobs."""
    async with open_channel(address) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        req = scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling, cache_salt="whole")
        tokens, lps = [], []
        async for ev in stub.Submit(req, timeout=120):
            tokens += list(ev.token_ids)
            lps += [lp.logprob for lp in ev.logprobs]
        return tokens, lps


async def through_balancer(address: str, ids: list[int], sampling: common_pb2.SamplingParams) -> tuple:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling)
        tokens, lps, usage = [], [], None
        async for msg in stub.Generate(req, timeout=120):
            tokens += list(msg.token_ids)
            lps += [lp.logprob for lp in msg.logprobs]
            if msg.HasField("finished"):
                usage = msg.finished.usage
        return tokens, lps, usage


@pytest.mark.timeout(300)
def test_a_disaggregated_request_gives_a_single_replicas_tokens(mesh) -> None:
    balancer = mesh.endpoints["http"].removesuffix("/v1") + "/metrics"
    deadline = time.monotonic() + 60
    while not (metric(balancer, "deepinfer_balancer_replicas", role="prefill") and metric(
            balancer, "deepinfer_balancer_replicas", role="decode")):  # fmt: skip
        assert time.monotonic() < deadline, "the balancer did not learn the replicas' roles"
        time.sleep(0.05)
    rng = random.Random(4)
    greedy = common_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    seeded = common_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=6, ignore_eos=True,
                                       logprobs=1)  # fmt: skip
    cases = [([rng.randrange(2, VOCAB) for _ in range(n)], s) for n, s in [(37, greedy), (21, seeded)]]

    async def run() -> list[tuple]:
        out = []
        for i, (ids, sampling) in enumerate(cases):
            ref = await whole(mesh.endpoints["scheduler-1"], f"whole-{i}", ids, sampling)
            out.append((ref, await through_balancer(mesh.endpoints["grpc"], ids, sampling)))
        return out

    for (ids, _), (ref, (tokens, lps, usage)) in zip(cases, asyncio.run(run())):
        assert len(tokens) == 6 and (tokens, lps) == ref
        assert usage.prompt_tokens == len(ids) and usage.cached_tokens == 0  # (the prefill replica's cache: cold)
    prefill = mesh.endpoints["scheduler-0 metrics"]
    prefilled = metric(prefill, "deepinfer_scheduler_requests_total", outcome="handed_off")
    # the decode replica resumed both from the prefill replica's export in the kvstore: no recompute
    assert prefilled == 2 and metric(balancer, "deepinfer_balancer_handoffs_total", source="kvstore") == 2


@pytest.mark.timeout(120)
def test_bad_handoff_fields_are_refused(mesh) -> None:
    async def run() -> list[grpc.StatusCode]:
        codes = []
        async with open_channel(mesh.endpoints["scheduler-1"]) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            sampling = common_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            for k, extra in enumerate([dict(resume_position=9), dict(resume_position=-1), dict(hand_off=True)]):
                req = scheduler_pb2.SubmitRequest(request_id=f"bad-{k}", prompt_token_ids=[5, 6, 7, 8],
                                                  sampling=sampling, **extra)  # fmt: skip
                try:
                    async for _ in stub.Submit(req, timeout=60):
                        pass
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        return codes

    # a position past the tokens, a negative one; a handoff is served by any replica with a kvstore
    assert asyncio.run(run()) == [grpc.StatusCode.INVALID_ARGUMENT] * 2 + [grpc.StatusCode.OK]


@pytest.mark.timeout(300)
def test_a_draining_replica_hands_its_streams_off(mesh) -> None:
    """Last: it stops the decode replica. Its drain hands the running stream off with its state (the grace is 2 s:
    its last second moves what still runs); the prefill replica, the one left, continues it from there."""
    rng = random.Random(9)
    ids = [rng.randrange(2, VOCAB) for _ in range(30)]
    # long enough to outlast the drain's first second (a token takes ~45 ms on 2 cores)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=1)
    balancer = mesh.endpoints["http"].removesuffix("/v1") + "/metrics"
    before = metric(balancer, "deepinfer_balancer_handoffs_total", source="kvstore")
    decode = dict(mesh.procs)["scheduler-1"]

    async def stream() -> tuple[list, list]:
        tokens, lps = [], []
        async with grpc.aio.insecure_channel(mesh.endpoints["grpc"]) as ch:
            req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling)
            async for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=240):
                if len(tokens) < 2 <= len(tokens) + len(msg.token_ids):  # decoding on the decode replica now
                    decode.send_signal(signal.SIGTERM)
                tokens += list(msg.token_ids)
                lps += [lp.logprob for lp in msg.logprobs]
        return tokens, lps

    async def run() -> tuple:  # the reference on the prefill replica meanwhile (batch invariant: the same tokens)
        return await asyncio.gather(whole(mesh.endpoints["scheduler-0"], "whole-drain", ids, sampling), stream())

    ref, got = asyncio.run(run())
    assert got == ref and len(got[0]) == 120
    assert decode.wait(timeout=60) == 0
    text = urllib.request.urlopen(balancer).read().decode()
    assert metric(balancer, "deepinfer_balancer_handoffs_total", source="kvstore") == before + 1, [
        ln for ln in text.splitlines() if "handoffs" in ln or "migrations" in ln]  # fmt: skip
