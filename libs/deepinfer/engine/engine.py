"""The in-process engine: scheduler + worker + detokenization, one model, one process.

``LLMEngine.step()`` turns the engine loop (``step_loop``: the one the scheduler service runs too) until a step's
result is in, applies its tokens and stop strings (``tokenizer.TextStream``: the one path the balancer takes too)
and returns the requests that finished. A request that fails validation is refused by
``add_request`` with a ValueError naming the field and never enters the queue, so the engine keeps
serving everything else. A request the worker cannot go on with (its structured-output grammar failed on the
worker: not loadable, its matcher erred) finishes with ``finish_reason`` ``"error"`` and ``error`` saying why —
never ``"stop"`` with output that may break its grammar.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from deepinfer.chat.turns import turn_boundaries
from deepinfer.engine.constraint import Constraint
from deepinfer.engine.interfaces import Runner, StepResult
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.engine.request import Request, validate_request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.step_loop import StepLoop, Turn
from deepinfer.sampling_params import SamplingParams
from deepinfer.telemetry import get_logger, request_context
from deepinfer.tokenizer import TextStream

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
    error: str | None = None  # finish_reason "error": why (e.g. "constraint.grammar: ...")


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
    """``async_scheduling``: two steps in flight, each ``step`` sends the next step before it collects the oldest,
    whose outputs it returns (``step_loop.StepLoop``'s pipelining)."""

    def __init__(
        self, scheduler: Scheduler, runner: Runner, tokenizer: object, vocab_size: int, async_scheduling: bool = False
    ) -> None:
        self.scheduler, self.runner, self.tokenizer, self.vocab_size = scheduler, runner, tokenizer, vocab_size
        self.async_scheduling = async_scheduling
        self.loop = StepLoop(scheduler, depth=2 if async_scheduling else 1)
        self._text: dict[str, TextStream] = {}
        self._fed: dict[str, int] = {}  # output tokens each request's text stream has taken
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
        mm: MultiModalInput | None = None,
    ) -> None:
        """Queue a request; ``mm``: its images, its prompt's placeholders already expanded
        (``multimodal.prepare_images``)."""
        validate_request(prompt_token_ids, params, self.vocab_size)
        if mm is not None and not isinstance(mm, MultiModalInput):
            raise ValueError(f"mm must be a MultiModalInput, got {type(mm).__name__}")
        try:
            hints = turn_boundaries(prompt_token_ids, self.tokenizer) if resume_hints is None else resume_hints
            self.scheduler.add(request_id, prompt_token_ids, params, cache_salt, hints, constraint, mm=mm)
        except ValueError as e:
            raise ValueError(f"prompt: {e}") from e
        self._prompts[request_id] = prompt
        with request_context(request_id):
            log.debug("request_added", prompt_tokens=len(prompt_token_ids))
        self._text[request_id] = TextStream(self.tokenizer, params)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.scheduler.abort(request_ids)
        return [self._finish(rid) for rid in request_ids if rid in self._text]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.loop.in_flight)

    def step(self) -> list[RequestOutput]:
        """Send the steps the loop plans until one step's result is due; apply it. Nothing to run: ``[]``."""
        while (turn := self.loop.turn(self.runner.waits_for_tokens)) is Turn.SEND:
            self.runner.send(self.loop.plan)
        return self._apply(self.runner.receive()) if turn is Turn.RECEIVE else []

    def _apply(self, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result: its tokens (several for a speculative verify step), stop strings; the requests
        that finished."""
        finished = {r.request_id for r in self.loop.received(result)}
        for r in result.results:
            req = self.scheduler.requests.get(r.request_id)
            if r.token_id is None or req is None or r.error is not None:
                continue
            stream, new = self._text[r.request_id], req.output_token_ids[self._fed.get(r.request_id, 0) :]
            for k, token in enumerate(new):
                # the request's own stop (EOS / a stop token) ended it on its last token: that one's text is not checked
                last = k == len(new) - 1
                stop = stream.add(token, ends=last and req.finish_reason == "stop")
                if stop is None:
                    continue
                del req.output_token_ids[len(req.output_token_ids) - len(new) + k + 1 :]  # what follows a stop string
                del req.logprobs[len(req.output_token_ids) :], req.top_logprobs[len(req.output_token_ids) :]
                if req.finished:
                    req.finish_reason, req.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(req, "stop", stop)
                finished.add(r.request_id)
                break
            self._fed[r.request_id] = len(req.output_token_ids)
        return [self._finish(rid) for rid in sorted(finished, key=lambda x: self.scheduler.requests[x].arrival)]

    def _finish(self, request_id: str) -> RequestOutput:
        req: Request = self.scheduler.pop_finished(request_id)
        stream = self._text.pop(request_id)
        self._fed.pop(request_id, None)
        prompt = self._prompts.pop(request_id)
        # the incremental text: a character still incomplete when generation ended is left out (no U+FFFD),
        # the same text the streaming API produces
        text = stream.text
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
                **({"error": req.error} if req.error else {}),
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
                CompletionOutput(
                    0, text, req.output_token_ids, cum, logprobs, req.finish_reason, req.stop_reason, req.error
                )
            ],
            finished=True,
            usage={
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
                "cached_tokens": req.num_cached_tokens,
                # speculative decoding: drafts verified, and kept (OpenAI's accepted / rejected prediction tokens)
                **(
                    {"draft_tokens": req.num_draft_tokens, "accepted_draft_tokens": req.num_accepted_tokens}
                    if req.num_draft_tokens
                    else {}
                ),
            },  # fmt: skip
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
            cache_tier=req.cache_tier if req.num_cached_tokens else None,
        )
