"""Rebalancing running requests between replicas by moving their state (docs/routing.md, "Rebalancing").

Through the launcher's mesh (two replicas, NATS, the kvstore, the balancer; real processes, grpcio): four requests
of one session all land on one replica (session affinity); the balancer's rebalancer (every 0.3 s here) finds the
other idle and has the busy one hand some of them off (half the gap, counting the moves on their way), their state
exported to the kvstore; they continue on the idle replica from that state, not recomputed. Every request's tokens
and logprobs are exactly those of the same request run whole on one replica (the batch-invariant ops). Without
processes: the rebalancer's choice."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2
from services.balancer.rebalance import Rebalancer
from services.balancer.replicas import Replica
from serving.launched import launched_mesh, metric
from serving.test_disaggregation import VOCAB, whole


class _Stub:
    def __init__(self, answer: list[str] | None = None, code: grpc.StatusCode | None = None) -> None:
        self.asked: list[list[str]] = []
        self.answer, self.code = answer, code

    async def HandOff(self, req: scheduler_pb2.HandOffRequest, timeout: float) -> scheduler_pb2.HandOffResponse:  # noqa: N802
        self.asked.append(list(req.request_ids))
        if self.code is not None:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no kvstore")
        ids = list(req.request_ids) if self.answer is None else self.answer
        return scheduler_pb2.HandOffResponse(request_ids=ids)


def test_the_rebalancers_choice() -> None:
    """Half the gap moves, from the busiest replica to the idlest, the requests with the most tokens left that have
    streamed a token; a small gap moves nothing; a replica without a kvstore is left alone afterwards."""
    busy = Replica("a", _Stub(), in_flight=6, role="mixed")
    idle = Replica("b", _Stub(), in_flight=1, role="mixed")
    live = {f"r{i}": (busy, f"r{i}.1", left, sent) for i, (left, sent) in
            enumerate([(50, 3), (90, 1), (70, 2), (200, 0), (10, 5), (60, 1)])}  # fmt: skip
    live["x"] = (idle, "x", 500, 9)
    moved: list[int] = []
    rb = Rebalancer(lambda: [busy, idle], lambda: live, moved.append)
    assert asyncio.run(rb.once(min_gap=4)) == 2
    assert busy.stub.asked == [["r1.1", "r2.1"]] and rb.targets == {"r1": idle, "r2": idle} and rb.moved == 2
    assert asyncio.run(rb.once(min_gap=2)) == 0  # the two on their way count at the idle replica: 4 against 3
    assert rb.arrived("r1") is idle and moved == [1] and rb.arrived("r7") is None  # only a move is counted
    del live["r1"]
    busy.in_flight, idle.in_flight = 5, 2  # (r1 arrived)
    assert asyncio.run(rb.once(min_gap=6)) == 0  # a gap of 5 - 1 - (2 + 1) = 1
    rb.forget("r2")
    busy.in_flight = 6
    busy.stub = _Stub(code=grpc.StatusCode.FAILED_PRECONDITION)
    assert asyncio.run(rb.once(min_gap=2)) == 0 and "a" in rb.refused and not rb.targets
    assert asyncio.run(rb.once(min_gap=2)) == 0 and len(busy.stub.asked) == 1  # asked once only
    decode = Replica("d", _Stub(), in_flight=0, role="decode")
    prefill = Replica("p", _Stub(), in_flight=0, role="prefill")
    rb2 = Rebalancer(lambda: [prefill, decode, Replica("d2", _Stub(), in_flight=5, role="decode")], lambda: {})
    assert [r.address for r in rb2._decoding()] == ["d", "d2"]  # disaggregated: the decode replicas only


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("rebalance")
    env = dict(DEEPINFER_BATCH_INVARIANT="1", DEEPINFER_INTERNAL_TOKEN="test-internal-token",
               DEEPINFER_REBALANCE_INTERVAL_S="0.3", DEEPINFER_REBALANCE_MIN_GAP="2")  # fmt: skip
    model = make_tiny_model(tmp / "model", seed=8)
    with launched_mesh(tmp, model, http=True, **env) as m:
        yield m


@pytest.mark.timeout(300)
def test_running_requests_move_to_the_idle_replica_with_their_state(mesh) -> None:
    rng = random.Random(5)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(20 + 3 * i)] for i in range(4)]
    balancer = mesh.endpoints["http"].removesuffix("/v1") + "/metrics"

    async def one(ids: list[int]) -> tuple[list, list]:
        async with grpc.aio.insecure_channel(mesh.endpoints["grpc"]) as ch:
            req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling,
                                                 session_id="one-session")  # fmt: skip
            tokens, lps = [], []
            async for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=240):
                tokens += list(msg.token_ids)
                lps += [lp.logprob for lp in msg.logprobs]
            return tokens, lps

    async def run() -> tuple[list, list]:
        refs = await asyncio.gather(*(whole(mesh.endpoints["scheduler-0"], f"whole-{i}", ids, sampling)
                                      for i, ids in enumerate(prompts)))  # fmt: skip
        return refs, await asyncio.gather(*(one(ids) for ids in prompts))

    refs, got = asyncio.run(run())
    assert got == refs and all(len(t) == 40 for t, _ in got)
    moved = metric(balancer, "deepinfer_balancer_rebalanced_total")
    assert moved >= 1  # (as many as had streamed a token when a round looked: half the gap at most)
    # each moved request continued from the state it exported, not recomputed (one moved twice counts once here)
    assert 1 <= metric(balancer, "deepinfer_balancer_handoffs_total", source="kvstore") <= moved
    assert metric(balancer, "deepinfer_balancer_handoffs_total", source="recompute") == 0
    handed = sum(metric(mesh.endpoints[f"scheduler-{i} metrics"], "deepinfer_scheduler_requests_total",
                        outcome="handed_off") for i in range(2))  # fmt: skip
    assert handed == moved
