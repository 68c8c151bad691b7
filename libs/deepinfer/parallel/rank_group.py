"""A worker's ranks in processes of their own: rank 0 drives the engine and runs its own share; every other rank
follows, taking its plan of each step from rank 0 and sending its result back.

The control channel (``Channel``) runs on a gloo group of its own, beside the one the MoE exchanges use (NCCL on
GPUs): a message is a header tensor ``[kind, length, flag]`` and the bytes of a protobuf message (a
``deepinfer.v1.StepPlan`` or ``StepResult``, the worker's wire forms; nothing is pickled). Rank 0's
``RankGroupRunner`` is the engine loop's runner (``engine.data_parallel.RankedPlan`` in, one merged result out):

* ``send``: each follower's plan goes out first (so every rank enters the step's exchanges), then rank 0 runs its
  own;
* ``receive``: rank 0 collects its own step, then asks each follower for its result, in rank order.

Every rank must run each MoE layer's exchange once per step in which any rank runs a forward
(``expert_parallel``): ``RankRunner`` counts the exchanges of its first MoE layer, and a rank whose plan ran no
forward in a busy step runs an idle one (one token on a throwaway state and the cache's scratch page).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.engine.data_parallel import RankedPlan
from deepinfer.engine.interfaces import StepResult, WorkerStepPlan
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.rpc.convert import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.v1 import worker_pb2

PLAN, COLLECT, RESULT, STOP = 1, 2, 3, 4


class Channel:
    """Messages between rank 0 and the other ranks over a gloo ``group``."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def send(self, dst: int, kind: int, payload: bytes = b"", flag: int = 0) -> None:
        dist.send(torch.tensor([kind, len(payload), flag], dtype=torch.long), dst, group=self.group)
        if payload:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group=self.group)

    def recv(self, src: int) -> tuple[int, bytes, int]:
        head = torch.empty(3, dtype=torch.long)
        dist.recv(head, src, group=self.group)
        kind, n, flag = (int(x) for x in head)
        data = b""
        if n:
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src, group=self.group)
            data = buf.numpy().tobytes()
        return kind, data, flag


class RankRunner:
    """One rank's ``ModelRunner``, keeping the rank in step with the others' MoE exchanges (module docstring)."""

    def __init__(self, runner: object) -> None:
        self.runner = runner

    @property
    def calls(self) -> int:
        """The exchanges the first MoE layer ran (every layer runs as often)."""
        return self.runner.model.layers[0].ffn.ep.calls

    def send(self, plan: WorkerStepPlan, busy: bool) -> None:
        before = self.calls
        self.runner.send(plan)
        ran = self.calls - before
        if ran > 1:
            raise RuntimeError(f"step {plan.step_id} ran {ran} forwards on this rank; every rank must run one")
        if busy and not ran:
            self.idle_forward()

    def receive(self) -> StepResult:
        return self.runner.receive()

    @torch.no_grad()
    def idle_forward(self) -> None:
        """One token through the model on a throwaway state, its pages the cache's scratch page."""
        r = self.runner
        table = torch.tensor([r.cache.scratch_page], dtype=torch.long, device=r.device)
        batch = ForwardBatch.build([SeqChunk(r.family.new_state(), 0, 1, table)], [[0]], device=r.device)
        r.model(batch, r.cache)


class RankGroupRunner:
    """Rank 0's runner of ``RankedPlan`` s: its own ``RankRunner`` and the followers over ``channel``."""

    def __init__(self, local: RankRunner, channel: Channel, world: int) -> None:
        self.local, self.channel, self.world = local, channel, world
        self._sent: list[set[str]] = [set() for _ in range(world)]  # requests whose parameters each rank has

    def send(self, plan: RankedPlan) -> None:
        busy = int(bool(plan.chunks))
        for r in range(1, self.world):
            msg = plan_to_proto(plan.ranks[r], self._sent[r]).SerializeToString()
            self.channel.send(r, PLAN, msg, busy)
        self.local.send(plan.ranks[0], bool(busy))

    def receive(self) -> StepResult:
        out = self.local.receive()
        for r in range(1, self.world):
            self.channel.send(r, COLLECT)
            kind, data, _ = self.channel.recv(r)
            if kind != RESULT:
                raise RuntimeError(f"rank {r} answered {kind} where a step's result was due")
            part = result_from_proto(worker_pb2.StepResult.FromString(data))
            if part.step_id != out.step_id:
                raise RuntimeError(f"rank {r} answered step {part.step_id} where step {out.step_id} was due")
            out.results += part.results
            out.fetched += part.fetched
        return out

    def waits_for_tokens(self, plan: RankedPlan) -> bool:
        """Rank 0's own rows as its runner says; another rank's structured-output rows always (rank 0 does not see
        whether their last tokens reached that rank's host)."""
        if self.local.runner.waits_for_tokens(plan.ranks[0]):
            return True
        return any(c.constraint is not None for sub in plan.ranks[1:] for c in sub.chunks)

    def close(self) -> None:
        """Tell the followers to stop (each leaves its loop and the group)."""
        for r in range(1, self.world):
            self.channel.send(r, STOP)


def follow(runner: RankRunner, channel: Channel) -> None:
    """A follower's loop: rank 0's plans run, their results sent back, until ``STOP``."""
    known: dict[str, SamplingParams] = {}
    while True:
        kind, data, flag = channel.recv(0)
        if kind == STOP:
            return
        if kind == PLAN:
            runner.send(plan_from_proto(worker_pb2.StepPlan.FromString(data), known), bool(flag))
        elif kind == COLLECT:
            channel.send(0, RESULT, result_to_proto(runner.receive()).SerializeToString())
        else:
            raise RuntimeError(f"rank 0 sent message kind {kind}")


__all__ = ["COLLECT", "PLAN", "RESULT", "STOP", "Channel", "RankGroupRunner", "RankRunner", "follow"]
