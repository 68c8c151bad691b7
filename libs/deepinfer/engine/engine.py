"""The in-process engine: scheduler + worker + detokenization, one model, one process.

``LLMEngine.step()`` plans a step, runs it on the worker, applies the sampled tokens, checks stop
strings and returns the requests that finished. A request that fails validation is refused by
``add_request`` with a ValueError naming the field and never enters the queue, so the engine keeps
serving everything else.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from deepinfer.chat.turns import turn_boundaries
from deepinfer.engine.constraints import Constraint
from deepinfer.engine.interfaces import StepResult, Worker, WorkerStepPlan
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.worker import InFlight
from deepinfer.sampling_params import SamplingParams
from deepinfer.telemetry import get_logger, request_context
from deepinfer.tokenizer import Detokenizer

log = get_logger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    usage: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_tier: str | None = None  # which tier served them: "device" or "kvstore"


class LLMEngine:
    """``async_scheduling`` (a worker with ``launch`` / ``finish``, e.g. :class:`ModelRunner`): each ``step`` plans
    and launches the next step before it collects the one in flight, whose outputs it returns."""

    def __init__(
        self, scheduler: Scheduler, worker: Worker, tokenizer: object, vocab_size: int, async_scheduling: bool = False
    ) -> None:
        self.scheduler, self.worker, self.tokenizer, self.vocab_size = (
            scheduler,
            worker,
            tokenizer,
            vocab_size,
        )
        self.async_scheduling = async_scheduling and hasattr(worker, "launch")
        self._in_flight: InFlight | None = None  # the step launched and not collected yet (async scheduling)
        self._detok: dict[str, Detokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        resume_hints: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate_for_model(self.vocab_size)
        if not prompt_token_ids:
            raise ValueError("prompt: empty prompt (at least one token is required)")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: {len(bad)} token ids outside the vocabulary [0, {self.vocab_size}), e.g. {bad[0]!r}"
            )
        try:
            hints = turn_boundaries(prompt_token_ids, self.tokenizer) if resume_hints is None else resume_hints
            self.scheduler.add(request_id, prompt_token_ids, params, cache_salt, hints, constraint)
        except ValueError as e:
            raise ValueError(f"prompt: {e}") from e
        self._prompts[request_id] = prompt
        with request_context(request_id):
            log.debug("request_added", prompt_tokens=len(prompt_token_ids))
        self._detok[request_id] = Detokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.scheduler.abort(request_ids)
        return [self._finish(rid) for rid in request_ids if rid in self._detok]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_async()
        plan = self._plan(lookahead=False)
        return self._apply(self.worker.execute(plan)) if plan is not None else []

    def _plan(self, lookahead: bool) -> WorkerStepPlan | None:
        """The next step, or None when there is nothing to run."""
        if lookahead and not (self.scheduler.has_unfinished() or self.scheduler.has_pending_releases):
            return None
        plan = self.scheduler.schedule(lookahead=lookahead)
        busy = plan.chunks or plan.released or plan.snapshots or plan.dropped_snapshots or plan.offloads
        return plan if busy or plan.fetches or self.scheduler.fetching else None

    def _step_async(self) -> list[RequestOutput]:
        """Launch the next step (requests in the step in flight continue on placeholders), then collect the one in
        flight. A step whose structured-output rows need the previous tokens on the host waits for them first."""
        prev, self._in_flight = self._in_flight, None
        plan = self._plan(lookahead=prev is not None)
        outputs: list[RequestOutput] = []
        if plan is not None:
            if prev is not None and self.worker.waits_for_tokens(plan):
                outputs, prev = self._apply(self.worker.finish(prev)), None
            self._in_flight = self.worker.launch(plan)
        if prev is not None:
            outputs = self._apply(self.worker.finish(prev))
        return outputs

    def _apply(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result: its tokens, stop strings; the requests that finished."""
        finished = {r.request_id for r in self.scheduler.update(result)}
        for r in result.results:
            req = self.scheduler.requests.get(r.request_id)
            if r.token_id is None or req is None:
                continue
            # as in vLLM: stop strings count once min_tokens are out, not after EOS / a stop token, and win
            # over "length" when both happen on the same token
            check = len(req.output_token_ids) >= req.params.min_tokens and req.finish_reason != "stop"
            stop = self._detok[r.request_id].add(r.token_id, check_stop=check)
            if stop is not None:
                if req.finished:
                    req.finish_reason, req.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(req, "stop", stop)
                finished.add(r.request_id)
        return [self._finish(rid) for rid in sorted(finished, key=lambda x: self.scheduler.requests[x].arrival)]

    def _finish(self, request_id: str) -> RequestOutput:
        req: Request = self.scheduler.pop_finished(request_id)
        detok = self._detok.pop(request_id)
        prompt = self._prompts.pop(request_id)
        # the incremental text: a character still incomplete when generation ended is left out (no U+FFFD),
        # the same text the streaming API produces
        text = detok.text
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = []
            for tok, lp, top in zip(req.output_token_ids, req.logprobs, req.top_logprobs):
                d = {tok: lp}
                for t, v in top or []:
                    d.setdefault(t, v)
                logprobs.append(d)
        cum = float(sum(req.logprobs)) if req.logprobs else None
        n_prompt, n_out = req.num_prompt_tokens, len(req.output_token_ids)
        with request_context(request_id):
            log.info(
                "request_finished",
                finish_reason=req.finish_reason,
                prompt_tokens=n_prompt,
                completion_tokens=n_out,
                preemptions=req.num_preemptions,
            )
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            outputs=[
                CompletionOutput(0, text, req.output_token_ids, cum, logprobs, req.finish_reason, req.stop_reason)
            ],
            finished=True,
            usage={
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
                "cached_tokens": req.num_cached_tokens,
            },  # fmt: skip
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
            cache_tier=req.cache_tier if req.num_cached_tokens else None,
        )
