"""Start a worker's ranks: rank 0 in this process, ranks ``1 .. N-1`` as processes of their own
(``deepinfer rank``), all in one ``torch.distributed`` group on loopback; and each rank's side of it.

The ranks take the same build arguments as text on their command line (nothing is pickled), build the same model
with their share of the experts (``ExpertParallel`` over an even placement), and check together that each sized
its paged cache alike (the data-parallel scheduler gives every rank the same pages). The MoE exchanges run on the
default group (the platform's ``collectives``: NCCL on NVIDIA GPUs, gloo on CPUs), the control channel on a gloo
group (of its own where the default is not gloo). A rank takes the device of its rank number
(``Platform.use_device``).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from deepinfer import envs
from deepinfer.engine.factory import EngineParts, build_worker
from deepinfer.engine.model_dir import resolve_model_dir
from deepinfer.parallel.all_to_all import TorchAllToAll
from deepinfer.parallel.context_parallel import ContextParallel
from deepinfer.parallel.expert_parallel import ExpertParallel, FixedBuffers
from deepinfer.parallel.layout import Layout
from deepinfer.parallel.placement import ExpertPlacement, routed_experts_of
from deepinfer.parallel.rank_group import Channel, RankGroupRunner, RankRunner
from deepinfer.parallel.tensor_parallel import TensorParallel
from deepinfer.runtime import shared_host
from deepinfer.runtime.platform import platform_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, accelerator: str) -> Channel:
    """Join the group (``rank`` of ``world`` on loopback ``port``); the control channel."""
    platform = platform_for(accelerator)
    platform.use_device(rank)
    timeout = datetime.timedelta(seconds=envs.DEEPINFER_RANK_TIMEOUT_S)  # a rank that stops answering fails the group
    dist.init_process_group(platform.collectives, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    gloo = platform.collectives == "gloo"
    return Channel(None if gloo else dist.new_group(backend="gloo", timeout=timeout))


def rank_groups(layout: Layout) -> tuple[TensorParallel | None, ContextParallel | None]:
    """This rank's tensor- or context-parallel group: ranks ``g·n .. g·n + n - 1`` of the worker, ``n`` the
    layout's group size (every rank creates every group, as ``torch.distributed`` requires); None for neither."""
    n = layout.group
    if n == 1:
        return None, None
    world, me = dist.get_world_size(), dist.get_rank()
    if world != layout.ranks:
        raise ValueError(f"a layout of {layout.ranks} ranks in a group of {world}")
    groups = [dist.new_group(list(range(g * n, (g + 1) * n))) for g in range(world // n)]
    if layout.tp > 1:
        return TensorParallel(groups[me // n], me % n, n), None
    return None, ContextParallel(groups[me // n], me % n, n)


def expert_group(n_experts: int, channel: Channel, layout: Layout | None = None) -> ExpertParallel:
    """This rank's share of every MoE layer: an even placement over the group, with its tensor- or context-parallel
    group (``rank_groups``: ``ep.tp``, ``ep.cp``); its ``host_key`` names what the ranks share on their host
    (``runtime.shared_host``), drawn by rank 0."""
    layout = layout or Layout(dist.get_world_size())
    a2a = TorchAllToAll()
    tp, cp = rank_groups(layout)
    fixed = FixedBuffers(envs.DEEPINFER_EP_FIXED_BUFFER_TOKENS, channel.group)
    fixed.check()
    # with EPLB, its slots per rank from the start: its moves then keep every tensor (graphs hold them)
    slots = -(-n_experts // a2a.size) + envs.DEEPINFER_EPLB_EXTRA_SLOTS if envs.DEEPINFER_EPLB_INTERVAL_STEPS > 0 else 0
    ep = ExpertParallel(ExpertPlacement.even(n_experts, a2a.size, slots), a2a, tp, fixed)
    ep.cp = cp
    key = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0])
    dist.broadcast(key, src=0, group=channel.group)
    ep.host_key = f"{int(key):016x}"
    if layout.group > 1:  # a group's ranks draw the same unseeded sampling noise: one seed each
        torch.manual_seed(int(key) + layout.group_of(dist.get_rank()))
    return ep


def same_pages(num_pages: int, channel: Channel) -> None:
    """Raise unless every rank sized its cache to ``num_pages``."""
    lo, hi = torch.tensor([num_pages]), torch.tensor([-num_pages])
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=channel.group)
    dist.all_reduce(hi, op=dist.ReduceOp.MIN, group=channel.group)
    if int(lo) != num_pages or -int(hi) != num_pages:
        raise RuntimeError(f"the ranks sized their caches differently ({int(lo)} to {-int(hi)} pages)")


def start_worker(layout: Layout, accelerator: str | None = None, **build: Any
                 ) -> tuple[EngineParts, RankProcesses | None]:  # fmt: skip
    """Build a worker (``engine.factory.build_worker`` with the arguments ``build``) of ``layout.ranks`` ranks: with
    more than one, ranks ``1 ..`` start in processes of their own, this process, rank 0, holds its share of the
    experts (and of the heads, with ``layout.tp`` > 1), and the worker's runner is the group's
    (``rank_group.RankGroupRunner``); the processes come back too (None for one rank). Every rank sizes its cache
    alike (checked)."""
    accelerator = accelerator or envs.DEEPINFER_ACCELERATOR
    ranks = layout.ranks
    if ranks == 1:
        return build_worker(accelerator=accelerator, **build), None
    dtype = build.get("dtype", "auto")
    args = {**build, "dtype": dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")}
    env = {}
    if accelerator == "cpu":  # the ranks of one host share its cores (DEEPINFER_TORCH_THREADS: the worker's in all)
        share = max(1, (envs.DEEPINFER_TORCH_THREADS or os.cpu_count() or 1) // ranks)
        env["DEEPINFER_TORCH_THREADS"] = str(share)
    procs = RankProcesses.start(ranks, {**args, "tp": layout.tp, "cp": layout.cp}, accelerator, env)
    group = None
    try:
        group = expert_group(routed_experts_of(resolve_model_dir(build.get("model"))[1]), procs.channel, layout)
        parts = build_worker(accelerator=accelerator, ep=group, **build)
        if env:
            torch.set_num_threads(int(env["DEEPINFER_TORCH_THREADS"]))
        same_pages(parts.num_pages, procs.channel)  # (every rank built: what they share is mapped by all)
        shared_host.release(group.host_key)
        runner = RankGroupRunner(RankRunner(parts.runner), procs.channel, layout)
        parts = dataclasses.replace(parts, runner=runner)
    except BaseException:
        if group is not None:
            shared_host.release(group.host_key)
        procs.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return parts, procs


@dataclass
class RankProcesses:
    """The follower processes of a rank group, and rank 0's channel to them."""

    world: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    channel: Channel | None = None

    @classmethod
    def start(cls, world: int, args: dict[str, object], accelerator: str, env: dict[str, str] | None = None
              ) -> RankProcesses:  # fmt: skip
        """Start ranks ``1 .. world-1`` (``deepinfer rank``, with the build arguments ``args``; None: left out; and
        this process's environment with ``env``) and join the group as rank 0."""
        port = free_port()
        flags = [x for k, v in args.items() if v is not None for x in (f"--{k.replace('_', '-')}", str(v))]
        out = cls(world)
        for r in range(1, world):
            cmd = [sys.executable, "-m", "deepinfer", "rank", "--rank", str(r), "--world", str(world), "--port",
                   str(port), "--accelerator", accelerator, *flags]  # fmt: skip
            out.procs.append(subprocess.Popen(cmd, env={**os.environ, **(env or {})}))
        try:
            out.channel = join(0, world, port, accelerator)
        except Exception:
            out.kill()
            raise
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def close(self, runner: object | None = None) -> None:
        """Stop the followers (``runner.close()`` tells them), wait for them, leave the group; a follower that does
        not answer (it died: the group failed) is killed."""
        try:
            if runner is not None:
                runner.close()
            for p in self.procs:
                p.wait(timeout=60)
        except Exception:  # (a dead or stuck rank: nothing left to tell it)
            self.kill()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class RanksLost(RuntimeError):
    """A worker of several ranks whose ranks could not be started again: it has nothing to serve with."""


class RankedWorker:
    """A worker of several ranks as its service holds it: how it was started (``layout``, ``accelerator``, the
    build arguments ``build`` of ``start_worker``) and its follower processes (``procs``)."""

    def __init__(self, layout: Layout, accelerator: str, build: dict[str, Any], procs: RankProcesses) -> None:
        self.layout, self.accelerator, self.build, self.procs = layout, accelerator, dict(build), procs

    def reload(self, take: Callable[[], Any], build: dict[str, Any]) -> tuple[EngineParts, Exception | None]:
        """Another model: every rank stopped and started afresh with ``build``. ``take()`` gives the group's runner
        (which tells the followers to stop) and drops the caller's hold on it, so that rank 0's model is freed
        before the new one loads, as the followers' are by their exit. Returns the new worker and None, or, where
        the new model failed to load, the worker started again with the arguments it ran with and the failure. A
        model that cannot be found fails before anything stops; ``RanksLost`` where the worker cannot be started
        again."""
        resolve_model_dir(build.get("model"))  # (ModelUnavailable, ValueError: the ranks keep running)
        self.procs.close(take())
        gc.collect()
        try:
            parts, self.procs = start_worker(self.layout, self.accelerator, **build)
        except Exception as e:  # noqa: BLE001 - any failure to load brings the old model back, then is reported
            try:
                parts, self.procs = start_worker(self.layout, self.accelerator, **self.build)
            except Exception as again:
                raise RanksLost(f"the worker's ranks could not start again after {e!r}: {again!r}") from again
            return parts, e
        self.build = dict(build)
        return parts, None


__all__ = [
    "RankProcesses",
    "RankedWorker",
    "RanksLost",
    "expert_group",
    "free_port",
    "join",
    "same_pages",
    "rank_groups",
    "start_worker",
]
