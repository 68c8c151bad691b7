"""Continuous-batching scheduler: admission, per-step token budget, chunked prefill, pages, preemption.

Each step it first continues the running requests in admission order (a decode token, or the next
prefill chunk), then admits waiting requests first-come-first-served while the token budget, the
sequence limit and the free pages allow. A sequence of ``L`` tokens holds ``ceil(L / page_size)``
pages. When a running request needs a page and none is free, the most recently admitted running
request is preempted: its pages are freed and it is re-queued at the front, to be recomputed from
its prompt and the tokens it already produced (the worker drops its state). A sequence ends with
"length" at ``max_model_len`` tokens, or at what the whole page pool holds if that is less.

Lookahead (the async pipeline): ``schedule(lookahead=k)`` may be called while ``k`` earlier steps are
still running. A request with tokens from those steps still in flight (at most one per step) then gets a
one-token chunk holding :data:`PLACEHOLDER`, which the worker replaces with the token it sampled last, so
the next step never waits for the previous ones' results. A request whose in-flight tokens may include its
last (``max_tokens`` or the length limit) gets none; one that turns out to stop on EOS costs one wasted
row per step planned past its end, dropped when their results arrive.

Prefix caching (``engine/prefix_cache.py``): a chunk that ends at a resume position (the prompt's end, or
a multiple of ``resume_interval``) and a finished sequence leave a resume point: its full pages stay
referenced and the next plan asks the worker for a snapshot of the short-term state. An admitted
request starts from the longest matching resume point; unused resume points are evicted (LRU) before
any running request is preempted.

Bounded decoder replay (DeepSeek-V4.1, ``decoder_replay`` = ``DEEPINFER_DECODER_REPLAY_TOKENS`` > 0): each prompt
chunk's plan carries ``decoder_from``, the first position whose decoder layers run (the prompt's last
``decoder_replay`` tokens), so however the prompt is chunked the decoder sees the same tokens; requests with prompt
logprobs, prompts with images and generated tokens run every layer. V4 models ignore it.

Images (``engine.multimodal``): a request's image spans travel with each chunk that covers part of one (a chunk may
cut a span: the model splices the slice it covers), and its prefix-cache keys fold in each image's digest.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence

from deepinfer.engine.constraint import Constraint
from deepinfer.engine.handoff import Handoffs
from deepinfer.engine.interfaces import (
    PLACEHOLDER,
    ChunkPlan,
    FetchOrder,
    OffloadOrder,
    SnapshotOrder,
    StepResult,
    WorkerStepPlan,
)
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.engine.pages import PagePool
from deepinfer.engine.prefix_cache import PrefixCache, ResumePoint
from deepinfer.engine.prefix_scheduling import PrefixCaching
from deepinfer.engine.remote_index import RemoteEntry, RemoteIndex
from deepinfer.engine.request import Request, Status, check_admission
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.engine.speculative.planning import draftable, speculating, track
from deepinfer.engine.speculative.policy import SpecPolicy
from deepinfer.engine.speculative.stats import SpecStats
from deepinfer.sampling_params import SamplingParams


class Scheduler(PrefixCaching, Handoffs):
    def __init__(self, config: SchedulerConfig, pages: PagePool) -> None:
        self.config, self.pages = config, pages
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._released: list[str] = []
        self._arrivals = 0
        self._step = 0
        self.num_preemptions = 0
        self.spec = SpecStats()  # speculative decoding: drafts verified and kept, steps run without
        self.spec_policy = SpecPolicy(config.spec_explore)  # ... and whether a step drafts, by measured cost
        self.prefix = PrefixCache(config.page_size, config.max_resume_points) if config.prefix_caching else None
        self._pending: list[tuple[str, ResumePoint]] = []  # resume points whose snapshot is not ordered yet
        self._dropped: list[str] = []  # snapshots the worker may drop
        remote = config.remote_store and self.prefix is not None
        self.remote = RemoteIndex(config.fingerprint, config.page_size) if remote else None  # kvstore entries
        self._offloads: list[OffloadOrder] = []
        self._fetches: list[FetchOrder] = []
        self.fetching: dict[str, tuple[Request, RemoteEntry]] = {}
        self.exporting: dict[str, list[tuple[Request, int]]] = {}  # handoffs waiting for exports (engine.handoff)
        self.kv_listeners: list[Callable[[str, ResumePoint, str], None]] = []  # device-tier KV events
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / served from the cache
        self.prefix_misses: Counter[str] = Counter()  # requests that found nothing, by reason

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
        """Queue a request. ``resume_hints``: prompt positions worth a resume point (chat turn ends);
        ``constraint``: what its sampled tokens obey (structured output), sent to the worker with its chunks;
        ``output_token_ids``: tokens it already generated elsewhere (a request moved from a failed replica): it
        continues after them, as if it had generated them here; ``mm``: its images (``engine.multimodal``), sent
        with the chunks that cover their spans and folded into its prefix-cache keys; ``hand_off``,
        ``resume_position``: disaggregation's two halves (``engine.handoff``)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pages = self._pages_for(len(prompt_token_ids) + 1)
        check_admission(prompt_token_ids, output_token_ids, params, self.config.max_model_len, self._max_len(), pages,
                        self.pages.num_total, self.config.page_size)  # fmt: skip
        req = Request(request_id, list(prompt_token_ids), params, arrival=self._arrivals, cache_salt=cache_salt)
        req.output_token_ids = list(output_token_ids)
        req.constraint = constraint
        if mm is not None:
            mm.check(len(prompt_token_ids))
            req.mm, req.cache_prompt = mm, mm.cache_tokens(prompt_token_ids)
        req.resume_hints = sorted({p for p in resume_hints if 0 < p < len(prompt_token_ids)})
        self._setup_handoff(req, hand_off, resume_position)
        self._arrivals += 1
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                self.finish(req, "abort")

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.finished:
            return
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason
        if 0 < req.num_computed <= req.num_tokens:  # the state covers known tokens only: keep it
            self._resume_point(req, req.num_computed)
        self._drop(req)

    def worker_lost(self) -> list[str]:
        """The worker lost every state it held (its stream broke, it restarted): drop every request (their ids are
        returned, for the caller to fail or move) and every device resume point; what the kvstore holds stays
        indexed. Afterwards every page is free and the next plan starts from nothing."""
        ids = list(self.requests)
        for req in self.requests.values():
            if req.pages:
                self.pages.free(req.pages)
                req.pages = []
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self.fetching.clear()
        self.exporting.clear()
        while self.prefix is not None and (rp := self.prefix.pop_lru()) is not None:
            self.pages.free(rp.pages)
            if rp.visible:
                self._kv_event("removed", rp, "worker_lost")
        for pending in (self._pending, self._released, self._dropped, self._offloads, self._fetches):
            pending.clear()
        return ids

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.fetching or self.exporting)

    @property
    def has_pending_releases(self) -> bool:
        """Requests whose worker state must still be dropped or snapshotted (sent with the next plan)."""
        return bool(self._released or self._pending or self._offloads or self._fetches or self.fetching
                    or self.exporting)  # fmt: skip

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, lookahead: int = 0) -> WorkerStepPlan:
        """The next step, planned while ``lookahead`` steps are in flight (0: none; True counts as 1): requests with
        tokens in flight (at most ``lookahead``) continue on a placeholder."""
        self._step += 1
        plan = WorkerStepPlan(step_id=self._step)
        for rid, rp in self._pending:
            plan.snapshots.append(SnapshotOrder(rid, rp.snapshot_id, rp.position))
            rp.visible = True
            self._kv_event("stored", rp, "snapshot")
        self._pending = []
        exports = any(o.export for o in self._offloads)  # handoffs' exports go in a step of their own (engine.handoff)
        budget = 0 if exports else self.config.max_num_batched_tokens
        spec = not exports and speculating(self.config, self.running, self.spec, self.spec_policy)
        # while a verify step is in flight, decode rows that would draft wait for it and verify with its requests in
        # the next step: a batch split once (a prefill in two chunks) would otherwise verify in two halves forever
        held = spec and any(r.verifying and r.in_flight for r in self.running)
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            drafts = 0
            if req.in_flight:
                speculates = spec and draftable(self.config, req, self._max_len()) > 0
                if req.verifying or speculates or req.in_flight > int(lookahead):
                    continue  # a request that speculates waits for its result (then verifies drafts)
                if not self._may_continue(req):
                    continue
                n = 1
            else:
                n = self._cut(req, min(req.num_tokens - req.num_computed, budget))
                if spec and n == 1 == req.num_tokens - req.num_computed:
                    drafts = max(0, min(draftable(self.config, req, self._max_len()), budget - 1))
                    if drafts and held:
                        continue
            if n <= 0:
                continue
            if not self._grow(req, req.num_computed + n + drafts):
                continue
            plan.chunks.append(self._chunk(req, n, drafts))
            budget -= n + drafts
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.in_flight:
                break  # preempted with a token in flight: recompute once that token has arrived
            if self._lookup(req):  # its resume point is in the kvstore: it waits for the fetch
                self.waiting.popleft()
                continue
            n = self._cut(req, min(req.num_tokens - req.num_computed, budget))
            need = self._pages_for(req.num_computed + n) - len(req.pages)
            if not self._reserve(need):
                self._unlookup(req)
                break
            self.waiting.popleft()
            req.pages += self.pages.allocate(need)
            req.status = Status.RUNNING
            self.running.append(req)
            if req.wants_prompt_logprobs and not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            plan.chunks.append(self._chunk(req, n))
            budget -= n
        plan.released, self._released = self._released, []
        plan.dropped_snapshots, self._dropped = self._dropped, []
        plan.offloads, self._offloads = self._offloads, []
        plan.fetches, self._fetches = self._fetches, []
        if self.config.num_speculative_tokens:
            track(self.spec_policy, plan)
        return plan

    def update(self, result: StepResult) -> list[Request]:
        """Record sampled tokens; returns the requests that finished (stop strings are the caller's)."""
        done: list[Request] = self._exports_done(result.exported)
        for f in result.fetched:
            self._fetch_done(f)
        for r in result.results:
            req = self.requests.get(r.request_id)
            if req is None or req.finished:
                continue
            if r.prompt_logprobs:
                req.prompt_logprobs.extend(r.prompt_logprobs)
            if r.error is not None:  # the worker cannot go on with it (its grammar failed): its token is not kept
                req.error = r.error
                self.finish(req, "error")
                done.append(req)
                continue
            if r.token_id is None:
                continue
            req.in_flight = max(0, req.in_flight - 1)
            req.verifying = False
            if req.status is Status.RUNNING:  # a verify step consumed the kept drafts too (the last token waits)
                req.num_computed += len(r.extra_token_ids)
            req.num_draft_tokens += r.num_drafts
            req.num_accepted_tokens += len(r.extra_token_ids)
            self.spec.record(r.num_drafts, len(r.extra_token_ids))
            lps = [r.logprob, *r.extra_logprobs] if r.logprob is not None else []
            tops = [r.top_logprobs, *r.extra_top_logprobs]
            for k, token in enumerate(r.token_ids):
                req.output_token_ids.append(token)
                if k < len(lps):
                    req.logprobs.append(lps[k])
                    req.top_logprobs.append(tops[k] if k < len(tops) else None)
                reason = self._stop_reason(req, token)
                if reason is not None and reason[0] == "handoff":  # reported once its state is exported
                    self._hand_off(req)
                elif reason is not None:  # the tokens after it are not part of the output
                    self.finish(req, *reason)
                    done.append(req)
                if reason is not None:
                    break
        if self.config.num_speculative_tokens:
            tokens = sum(len(r.token_ids) for r in result.results)
            self.spec_policy.observed(result.step_id, tokens, bool(self.running or self.waiting),
                                      one_time=result.graph_captures > 0)  # fmt: skip
        return done

    # -- internals ---------------------------------------------------------------------------
    def _stop_reason(self, req: Request, token: int) -> tuple[str, int | None] | None:
        p, n_out = req.params, len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token == self.config.eos_token_id and not p.ignore_eos:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length", None
        if req.num_tokens >= self._max_len():
            return "length", None
        return ("handoff", None) if self._handoff_due(req, n_out) else None

    def _may_continue(self, req: Request) -> bool:
        """Whether a request whose token is in flight can certainly take one more step."""
        p, n_out = req.params, len(req.output_token_ids) + req.in_flight
        if (p.max_tokens is not None and n_out >= p.max_tokens) or self._handoff_due(req, n_out):
            return False
        return req.num_tokens + req.in_flight < self._max_len()

    def _max_len(self) -> int:
        """The longest a sequence may grow: the model's limit, or what the whole page pool holds if less.
        (A sequence that outgrew the pool could never be scheduled again: it would preempt itself forever.)"""
        return min(self.config.max_model_len, self.pages.num_total * self.config.page_size)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens, preempting the newest requests if needed."""
        need = self._pages_for(num_tokens) - len(req.pages)
        while need > 0 and not self._reserve(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.pages.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self._drop(req)
        req.status, req.num_computed, req.num_cached_tokens, req.cache_tier = Status.WAITING, 0, 0, None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _drop(self, req: Request) -> None:
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.num_computed:
            self._released.append(req.request_id)
        req.num_computed, req.constraint_sent = 0, False
        if req.fetched is not None and req.resume_from != req.fetched[0]:  # fetched, never used
            self._dropped.append(req.fetched[0])
            req.fetched = None

    def _chunk(self, req: Request, n: int, drafts: int = 0) -> ChunkPlan:
        start = req.num_computed
        tokens = req.token_slice(start, start + n) if start < req.num_tokens else [PLACEHOLDER]
        req.num_computed += n
        if req.num_computed <= req.num_tokens and self._is_resume_position(req, req.num_computed):
            self._resume_point(req, req.num_computed)
        resume, req.resume_from = req.resume_from, None
        if req.fetched is not None and resume == req.fetched[0]:
            req.fetched = None  # the worker consumes the fetched state with this chunk
        targets = None
        if req.wants_prompt_logprobs:
            scored = len(req.prompt_logprobs)  # entries for prompt tokens 0 .. scored-1
            targets = [
                req.prompt_token_ids[j + 1] if scored <= j + 1 < req.num_prompt_tokens else -1
                for j in range(start, start + n)
            ]
            if all(t < 0 for t in targets):
                targets = None
        sample = req.num_computed == req.num_tokens + req.in_flight
        if sample:
            req.in_flight += 1
            req.verifying = drafts > 0
        constraint = req.constraint if not req.constraint_sent else None
        req.constraint_sent = req.constraint is not None
        return ChunkPlan(
            request_id=req.request_id,
            token_ids=tokens,
            start=start,
            block_table=list(req.pages),
            sample=sample,
            params=req.params,
            logprob_targets=targets,
            resume_from=resume,
            constraint=constraint,
            constraint_history=list(req.output_token_ids) if constraint is not None else None,
            decoder_from=self._decoder_from(req, start),
            mm=req.mm if req.mm is not None and req.mm.overlaps(start, start + n) else None,
            num_drafts=drafts if sample else 0,
        )

    def _decoder_from(self, req: Request, start: int) -> int | None:
        """Bounded decoder replay (V4.1): a prompt chunk runs the decoder layers from the prompt's last
        ``decoder_replay`` tokens on; generated tokens, and every token of a request that scores its prompt
        (prompt logprobs), and a prompt with images, run all layers (None)."""
        n = self.config.decoder_replay
        if not n or start >= req.num_prompt_tokens or req.wants_prompt_logprobs or req.mm is not None:
            return None
        return max(start, req.num_prompt_tokens - n)
