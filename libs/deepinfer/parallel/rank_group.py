"""A worker's ranks in processes of their own: rank 0 drives the engine and runs its own share; every other rank
follows, taking its plan of each step from rank 0 and sending its result back.

The control channel (``Channel``) runs on a gloo group of its own, beside the one the MoE exchanges use (NCCL on
GPUs): a message is a header tensor ``[kind, length, flag]`` and the bytes of a protobuf message (a
``deepinfer.v1.StepPlan`` or ``StepResult``, the worker's wire forms; nothing is pickled). Rank 0's
``RankGroupRunner`` is the runner of the engine loop and of the worker service (``engine.interfaces.RankedPlan``
in, one merged result out):

* ``launch`` / ``send``: each follower's plan goes out first (so every rank enters the step's exchanges), then
  rank 0 launches its own;
* ``finish`` / ``receive``: rank 0 collects its own step, then asks each follower for its result, in rank order;
* ``release``: the requests' state dropped on every rank (a ``RELEASE`` message: a ``StepPlan`` of ``released``
  only);
* EPLB (``DEEPINFER_EPLB_INTERVAL_STEPS``): an ``EXPERTS`` message ahead of a step's plans, and every rank runs one
  rebalance (``expert_balancer``).

Every rank must run each MoE layer's exchange as many times a step as any other rank (``expert_parallel``): rank 0
decides how many forwards each rank runs in a step, one, or two where some rank's step may run its verify rows apart
from a prompt chunk (``models.deepseek_v4.verify_split.forwards``; the ``TWO`` flag); ``RankRunner`` counts the
forwards its runner ran (the steps and their splits, not the exchanges: a replayed CUDA graph runs no Python), and
a rank whose plan ran fewer in a busy step runs idle ones (one token on a throwaway state and the cache's scratch
page).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from deepinfer import envs
from deepinfer.engine.interfaces import RankedPlan, StepResult, WorkerStepPlan
from deepinfer.engine.worker import InFlight, ModelRunner
from deepinfer.models.deepseek_v4 import verify_split
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.parallel.expert_balancer import ExpertBalancer, follow_rebalance
from deepinfer.parallel.expert_parallel import FixedBuffers
from deepinfer.parallel.layout import Layout
from deepinfer.rpc.convert import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.v1 import worker_pb2

PLAN, COLLECT, RESULT, STOP, RELEASE, EXPERTS = 1, 2, 3, 4, 5, 6
# a PLAN's flag bits: some rank runs a forward; the exchanges' form (neither: agree); every rank runs two forwards
BUSY, FIXED, COUNTS, TWO = 1, 2, 4, 8


def step_form(plans: list[WorkerStepPlan], layout: Layout, tokens: int) -> bool | None:
    """Whether every rank's MoE exchanges of a step (``plans``: each data-parallel group's) go through the fixed
    buffers of ``tokens`` tokens a rank: the most tokens any rank may send, its group's tokens and drafts (a
    tensor-parallel rank its share of them; a rank with nothing to run one, its idle forward's), within ``tokens``.
    Decided here, before the step, so that no rank agrees inside its forward (``expert_parallel.FixedBuffers``).
    None: ``tokens`` 0 (never fixed)."""
    if tokens <= 0:
        return None
    most = 0
    for p in plans:
        n = sum(len(c.token_ids) + c.num_drafts for c in p.chunks) or 1
        most = max(most, -(-n // layout.tp))
    return most <= tokens


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

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.launched: collections.deque[InFlight] = collections.deque()

    @property
    def calls(self) -> int:
        """The forwards the runner ran (each runs every MoE layer's exchange once): its steps, and one more for each
        step its model ran as two (``split_steps``)."""
        return self.runner.forwards + getattr(self.runner.model, "split_steps", 0)

    @property
    def fixed(self) -> FixedBuffers | None:
        """The model's ``FixedBuffers`` (None: the exchanges always send their counts, or no exchanges)."""
        ep = getattr(self.runner.model.layers[0].ffn, "ep", None)
        return None if ep is None else ep.fixed

    def launch(self, plan: WorkerStepPlan, busy: bool, fixed: bool | None = None, forwards: int = 1) -> InFlight:
        """Run the step, then idle forwards up to ``forwards`` where the group is busy (as many forwards as every
        rank runs, rank 0's decision: ``verify_split.forwards``); ``fixed``: its exchanges' form as rank 0 decided it
        (``step_form``; None: the first MoE layer agrees)."""
        before, buffers = self.calls, self.fixed
        gate = getattr(self.runner.model, "replay_gate", None)
        if buffers is not None:
            buffers.decided = fixed
        if gate is not None:
            gate.forwards = forwards
        try:
            step = self.runner.launch(plan)
            ran = self.calls - before
            if ran > forwards:
                raise RuntimeError(f"step {plan.step_id} ran {ran} forwards on this rank; every rank runs {forwards}")
            for _ in range(forwards - ran if busy else 0):
                self.idle_forward()
        finally:
            if buffers is not None:
                buffers.decided = None
            if gate is not None:
                gate.forwards = 1
        return step

    def send(self, plan: WorkerStepPlan, busy: bool, fixed: bool | None = None, forwards: int = 1) -> None:
        self.launched.append(self.launch(plan, busy, fixed, forwards))

    def receive(self) -> StepResult:
        return self.runner.finish(self.launched.popleft())

    @torch.no_grad()
    def idle_forward(self) -> None:
        """One token through the model on a throwaway state, its pages the cache's scratch page (from a graph where
        the model's ``replay_gate`` allows it, as any step: the exchanges are the same)."""
        r = self.runner
        table = torch.tensor([r.cache.scratch_page], dtype=torch.long, device=r.device)
        batch = ForwardBatch.build([SeqChunk(r.family.new_state(), 0, 1, table)], [[0]], device=r.device)
        r.model(batch, r.cache)


class RankGroupRunner:
    """Rank 0's runner of ``RankedPlan`` s: its own ``RankRunner`` and the followers over ``channel``. The runner
    contract of both the engine loop (``send`` / ``receive``) and the worker service's pipeline (``launch`` /
    ``finish``, ``release``); the local runner's device, kvstore client, drafter and constraints stand for the
    group's (every rank builds the same)."""

    def __init__(self, local: RankRunner, channel: Channel, layout: Layout) -> None:
        self.local, self.channel, self.layout = local, channel, layout
        self.world = world = layout.ranks
        self._sent: list[set[str]] = [set() for _ in range(world)]  # requests whose parameters each rank has
        self._launched: collections.deque[InFlight] = collections.deque()
        self.broken: str | None = None  # why the group can run no more steps (``_group_step``), or None
        runner = local.runner
        self.balancer: ExpertBalancer | None = None  # EPLB (``expert_balancer``), every so many steps
        if envs.DEEPINFER_EPLB_INTERVAL_STEPS > 0:
            self.balancer = ExpertBalancer(runner.model, channel.group, envs.DEEPINFER_EPLB_INTERVAL_STEPS,
                                           envs.DEEPINFER_EPLB_EXTRA_SLOTS)  # fmt: skip
        self.device, self.remote = runner.device, runner.remote
        self.spec, self.constraints = runner.spec, runner.constraints

    def launch(self, plan: WorkerStepPlan) -> InFlight:
        """Send each follower its plan (so every rank enters the step's exchanges), then launch rank 0's. A plan
        has a step per data-parallel group (``Layout.dp``); every rank of a tensor- or context-parallel group runs
        its group's."""
        dp = self.layout.dp
        if dp == 1 and not isinstance(plan, RankedPlan):  # (one data-parallel group: the plan of a single worker)
            plan = RankedPlan.of([plan])
        if not isinstance(plan, RankedPlan) or len(plan.ranks) != dp:
            got = len(plan.ranks) if isinstance(plan, RankedPlan) else 1
            raise ValueError(f"ranks: the plan has {got} ranks' steps, this worker has {dp} data-parallel ranks")
        busy = bool(plan.chunks)
        buffers, model = self.local.fixed, self.local.runner.model
        fixed = None if buffers is None else step_form(plan.ranks, self.layout, buffers.tokens)
        forwards = max(verify_split.forwards(model, [(len(c.token_ids), c.num_drafts) for c in p.chunks])
                       for p in plan.ranks)  # fmt: skip
        flag = int(busy) | (0 if fixed is None else FIXED if fixed else COUNTS) | (TWO if forwards == 2 else 0)
        with self._group_step():
            if self.balancer is not None and self.balancer.due():  # between two steps, before this one's plans
                for r in range(1, self.world):
                    self.channel.send(r, EXPERTS)
                self.balancer.rebalance()
            for r in range(1, self.world):
                msg = plan_to_proto(plan.ranks[self.layout.group_of(r)], self._sent[r]).SerializeToString()
                self.channel.send(r, PLAN, msg, flag)
            return self.local.launch(plan.ranks[0], busy, fixed, forwards)

    def finish(self, step: InFlight) -> StepResult:
        """Rank 0's result of the step, then each follower's, in rank order, merged: the first rank's of each
        tensor- or context-parallel group (the others computed the same)."""
        with self._group_step():
            out = self.local.runner.finish(step)
            for r in range(1, self.world):
                self.channel.send(r, COLLECT)
                kind, data, _ = self.channel.recv(r)
                if kind != RESULT:
                    raise RuntimeError(f"rank {r} answered {kind} where a step's result was due")
                part = result_from_proto(worker_pb2.StepResult.FromString(data))
                if part.step_id != out.step_id:
                    raise RuntimeError(f"rank {r} answered step {part.step_id} where step {out.step_id} was due")
                out.graph_captures = max(out.graph_captures, part.graph_captures)  # (every rank captures alike)
                if r % self.layout.group:
                    continue
                out.results += part.results
                out.fetched += part.fetched
                out.exported += part.exported
            return out

    @contextlib.contextmanager
    def _group_step(self) -> Iterator[None]:
        """A step's work across the ranks: after a failure in it the ranks are out of step (a rank died, hung or
        failed while the others wait in an exchange), and the group can run nothing more (``broken``)."""
        if self.broken is not None:
            raise RuntimeError(f"the worker's rank group is broken: {self.broken}")
        try:
            yield
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def send(self, plan: RankedPlan) -> None:
        self._launched.append(self.launch(plan))

    def receive(self) -> StepResult:
        return self.finish(self._launched.popleft())

    def release(self, request_ids: list[str]) -> None:
        """Drop the requests' state on every rank (the worker service's stream ended)."""
        msg = worker_pb2.StepPlan(released=request_ids).SerializeToString()
        self.local.runner.release(request_ids)
        if self.broken is None:
            with self._group_step():
                for r in range(1, self.world):
                    self._sent[r].difference_update(request_ids)
                    self.channel.send(r, RELEASE, msg)

    def waits_for_tokens(self, plan: RankedPlan) -> bool:
        """Rank 0's own rows as its runner says; another rank's structured-output rows always (rank 0 does not see
        whether their last tokens reached that rank's host), those of rank 0's tensor- or context-parallel peers
        too; a plan that is not one of ranks: no (``launch`` refuses it), except the plain plan of one data-parallel
        group."""
        if self.layout.dp == 1 and not isinstance(plan, RankedPlan):
            plan = RankedPlan.of([plan])
        if not isinstance(plan, RankedPlan) or not plan.ranks:
            return False
        if self.local.runner.waits_for_tokens(plan.ranks[0]):
            return True
        others = plan.ranks if self.layout.group > 1 else plan.ranks[1:]
        return any(c.constraint is not None for sub in others for c in sub.chunks)

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
            fixed = True if flag & FIXED else False if flag & COUNTS else None
            plan = plan_from_proto(worker_pb2.StepPlan.FromString(data), known)
            runner.send(plan, bool(flag & BUSY), fixed, 2 if flag & TWO else 1)
        elif kind == COLLECT:
            channel.send(0, RESULT, result_to_proto(runner.receive()).SerializeToString())
        elif kind == EXPERTS:
            follow_rebalance(runner.runner.model, channel.group)
        elif kind == RELEASE:
            ids = list(worker_pb2.StepPlan.FromString(data).released)
            for rid in ids:
                known.pop(rid, None)
            runner.runner.release(ids)
        else:
            raise RuntimeError(f"rank 0 sent message kind {kind}")


__all__ = [
    "BUSY",
    "COLLECT",
    "COUNTS",
    "EXPERTS",
    "FIXED",
    "PLAN",
    "RELEASE",
    "RESULT",
    "STOP",
    "TWO",
    "Channel",
    "RankGroupRunner",
    "RankRunner",
    "follow",
    "step_form",
]
