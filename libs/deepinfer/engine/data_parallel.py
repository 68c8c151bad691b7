"""Attention data parallelism: one scheduler per rank of a worker that spans several devices, seen by the engine loop
as one scheduler, and the plan of a step as one plan per rank.

Each rank of such a worker attends over its own sequences, with its own KV cache and state (``parallel``: the MoE
layers are shared across the ranks by expert parallelism). So each rank has its own ``Scheduler`` with its own
page pool, prefix cache, preemption and token budget (``DataParallelScheduler.ranks``), and a request lives on one
rank from admission to its end:

* **placement** (``add``): the rank whose prefix cache holds the longest resume point of the prompt, where one
  does; else the least loaded: fewest tokens left to compute (waiting and running), then most pages available,
  then the lowest rank; a request with images on rank 0 (where the image features are);
* **spreading** (``schedule``, before the ranks plan): a rank with nothing waiting and room for another sequence
  takes a waiting request that another rank has not started (no state on its worker: never run, no pages, no
  fetch, no images) and cannot start now (its sequences or pages are taken by those running and those ahead in
  its queue), unless that rank holds more of its prompt in its prefix cache; so a rank whose requests ended
  early does not idle while another's queue waits;
* **a step** (``schedule``): every rank plans its step (the same step number on all: each plans every step, an
  empty one if it has nothing), and the step's plan is a ``RankedPlan``: the ranks' plans, with the union of
  their chunks and orders for what looks at a plan as a whole (the engine loop: is there anything to send?);
* **a result** (``update``): split by the rank each request lives on (kvstore fetches: by the rank that ordered
  them) and applied to each rank's scheduler.

A worker's ranks in processes of their own run such plans: ``parallel.rank_group``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from deepinfer.engine.constraint import Constraint
from deepinfer.engine.interfaces import RankedPlan, StepResult
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.engine.pages import PagePool
from deepinfer.engine.prefix_cache import root_hash
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.sampling_params import SamplingParams


class DataParallelScheduler:
    """``ranks`` schedulers of ``pages`` pages each behind the ``Scheduler`` interface the engine loop uses
    (module docstring)."""

    def __init__(self, config: SchedulerConfig, pages: int, ranks: int) -> None:
        if ranks < 1:
            raise ValueError(f"a data-parallel scheduler needs at least one rank, got {ranks}")
        self.config = config
        self.ranks = [Scheduler(config, PagePool(pages)) for _ in range(ranks)]
        self.rank_of: dict[str, int] = {}
        self._fetch_rank: dict[str, int] = {}
        self.requests = collections.ChainMap(*(s.requests for s in self.ranks))
        # shared by the ranks: the speculation counters, the device-tier KV event listeners (a resume point is
        # this replica's whichever rank holds it) and the index of what the kvstore holds (any rank may fetch it)
        first = self.ranks[0]
        self.spec, self.kv_listeners, self.remote = first.spec, first.kv_listeners, first.remote
        for s in self.ranks[1:]:
            s.spec, s.kv_listeners, s.remote = self.spec, self.kv_listeners, self.remote
        # whether a step drafts is measured per rank (each plans its own); the metrics show rank 0's estimates
        self.spec_policy = first.spec_policy

    # -- requests ----------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resume_hints: Sequence[int] = (),
        constraint: Constraint | None = None,
        output_token_ids: Sequence[int] = (),
        mm: MultiModalInput | None = None,
        hand_off: bool = False,
        resume_position: int = 0,
    ) -> None:
        """``Scheduler.add`` on the rank chosen for the request (module docstring)."""
        if request_id in self.rank_of:
            raise ValueError(f"request_id {request_id!r} is already in use")
        r = self.place(prompt_token_ids, cache_salt, mm is not None)
        self.ranks[r].add(request_id, prompt_token_ids, params, cache_salt, resume_hints, constraint,
                          output_token_ids, mm, hand_off, resume_position)  # fmt: skip
        self.rank_of[request_id] = r

    def place(self, prompt: Sequence[int], cache_salt: str | None = None, images: bool = False) -> int:
        """The rank a new request with ``prompt`` goes to; a request with images: rank 0, whose process holds the
        image features (the worker service's ``PrepareImages``, the engine's encoder)."""
        if images:
            return 0
        if self.ranks[0].prefix is not None and len(prompt) > 1:
            root = root_hash(self.config.fingerprint, cache_salt)
            hits = [(s.prefix.peek(prompt, root, len(prompt) - 1), r) for r, s in enumerate(self.ranks)]
            best, r = max(hits, key=lambda h: (h[0], -h[1]))
            if best > 0:
                return r
        return min(range(len(self.ranks)), key=lambda r: (*self._load(self.ranks[r]), r))

    @staticmethod
    def _load(s: Scheduler) -> tuple[int, int]:
        left = sum(q.num_tokens - q.num_computed for q in (*s.waiting, *s.running))
        return left, -s.num_available_pages

    def worker_lost(self) -> list[str]:
        """``Scheduler.worker_lost`` on every rank (the worker's ranks went down together)."""
        self.rank_of.clear()
        self._fetch_rank.clear()
        return [rid for s in self.ranks for rid in s.worker_lost()]

    def add_remote(self, anchor_: bytes, position: int, tag: bytes) -> None:
        self.ranks[0].add_remote(anchor_, position, tag)  # (the index is shared)

    def remove_remote(self, tag: bytes) -> None:
        self.ranks[0].remove_remote(tag)

    def abort(self, request_ids: list[str]) -> None:
        for r, ids in self._by_rank(request_ids).items():
            self.ranks[r].abort(ids)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.ranks[self.rank_of[req.request_id]].finish(req, reason, stop_reason)

    def hand_off_all(self) -> None:
        for s in self.ranks:
            s.hand_off_all()

    def hand_off(self, request_ids: list[str]) -> list[str]:
        return [rid for r, ids in self._by_rank(request_ids).items() for rid in self.ranks[r].hand_off(ids)]

    def pop_finished(self, request_id: str) -> Request:
        return self.ranks[self.rank_of.pop(request_id)].pop_finished(request_id)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.ranks)

    @property
    def has_pending_releases(self) -> bool:
        return any(s.has_pending_releases for s in self.ranks)

    @property
    def fetching(self) -> collections.ChainMap:
        return collections.ChainMap(*(s.fetching for s in self.ranks))

    @property
    def exporting(self) -> collections.ChainMap:
        return collections.ChainMap(*(s.exporting for s in self.ranks))

    @property
    def waiting(self) -> list[Request]:
        return [q for s in self.ranks for q in s.waiting]

    @property
    def running(self) -> list[Request]:
        return [q for s in self.ranks for q in s.running]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    @property
    def num_available_pages(self) -> int:
        return sum(s.num_available_pages for s in self.ranks)

    @property
    def num_total_pages(self) -> int:
        return sum(s.num_total_pages for s in self.ranks)

    @property
    def num_resume_points(self) -> int:
        return sum(s.num_resume_points for s in self.ranks)

    @property
    def prefix_queries(self) -> int:
        return sum(s.prefix_queries for s in self.ranks)

    @property
    def prefix_hits(self) -> int:
        return sum(s.prefix_hits for s in self.ranks)

    @property
    def prefix_misses(self) -> collections.Counter[str]:
        return sum((s.prefix_misses for s in self.ranks), collections.Counter())

    def reset_prefix_cache(self) -> None:
        for s in self.ranks:
            s.reset_prefix_cache()

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, lookahead: int = 0) -> RankedPlan:
        self._spread()
        plans = [s.schedule(lookahead) for s in self.ranks]
        for r, p in enumerate(plans):
            for f in p.fetches:
                self._fetch_rank[f.fetch_id] = r
            for o in p.offloads:
                if o.export:
                    self._fetch_rank[o.snapshot_id] = r
        return RankedPlan.of(plans)

    def update(self, result: StepResult) -> list[Request]:
        parts = [StepResult(result.step_id, graph_captures=result.graph_captures) for _ in self.ranks]
        for res in result.results:
            r = self.rank_of.get(res.request_id)
            if r is not None:
                parts[r].results.append(res)
        for f in result.fetched:
            parts[self._fetch_rank.pop(f.fetch_id, 0)].fetched.append(f)
        for e in result.exported:  # (the rank that ordered the export)
            parts[self._fetch_rank.pop(e.snapshot_id, 0)].exported.append(e)
        return [req for s, part in zip(self.ranks, parts) for req in s.update(part)]

    def _spread(self) -> None:
        """Move waiting requests no rank has started to ranks with room and nothing waiting (module docstring)."""
        for d, dst in enumerate(self.ranks):
            while not dst.waiting and len(dst.running) < self.config.max_num_seqs:
                got = self._movable(d)
                if got is None:
                    break
                src, req = got
                src.waiting.remove(req)
                del src.requests[req.request_id]
                req.arrival, dst._arrivals = dst._arrivals, dst._arrivals + 1
                dst.requests[req.request_id] = req
                dst.waiting.append(req)
                self.rank_of[req.request_id] = d

    def _movable(self, d: int) -> tuple[Scheduler, Request] | None:
        """The first waiting request of another rank that rank ``d`` can take and start now, with its rank."""
        dst = self.ranks[d]
        for r, src in enumerate(self.ranks):
            if r == d:
                continue
            need = 0  # pages the requests ahead in its queue, and it, take on its rank
            for i, req in enumerate(src.waiting):
                need += src._pages_for(req.num_tokens + 1)
                if len(src.running) + i < self.config.max_num_seqs and need <= src.num_available_pages:
                    continue  # its own rank has room for it
                if (req.status is not Status.WAITING or req.num_computed or req.pages or req.in_flight
                        or req.num_preemptions or req.fetch_id or req.fetched or req.mm is not None):  # fmt: skip
                    continue
                if dst._pages_for(req.num_tokens + 1) > dst.num_available_pages:
                    continue
                if self._cached(src, req) > self._cached(dst, req):
                    continue
                return src, req
        return None

    def _cached(self, s: Scheduler, req: Request) -> int:
        """How much of ``req``'s prompt rank ``s``'s prefix cache holds."""
        prompt = req.prompt_token_ids
        if s.prefix is None or len(prompt) < 2:
            return 0
        return s.prefix.peek(prompt, root_hash(self.config.fingerprint, req.cache_salt), len(prompt) - 1)

    def _by_rank(self, request_ids: list[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self.rank_of:
                out.setdefault(self.rank_of[rid], []).append(rid)
        return out


__all__ = ["DataParallelScheduler", "RankedPlan"]
