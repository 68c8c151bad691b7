"""A request as the scheduler tracks it."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.engine.constraint import Constraint
from deepinfer.engine.multimodal import MultiModalInput
from deepinfer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV state exists on the worker
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": why (the worker's ``SeqResult.error``)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_preemptions: int = 0
    in_flight: int = 0  # sampled tokens scheduled whose result has not arrived (the async pipeline)
    verifying: bool = False  # a speculative verify step of it is in flight: how many tokens it emits is unknown
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for it
    num_accepted_tokens: int = 0  # ... and kept (each one a token of its output)
    cache_salt: str | None = None  # isolates this tenant's prefix-cache entries
    num_cached_tokens: int = 0  # prompt tokens served from a resume point
    cache_tier: str | None = None  # where that resume point was: "device" or "kvstore"
    cache_miss_reason: str | None = None  # why no resume point served it (prefix_cache.MISS_REASONS)
    resume_from: str | None = None  # the snapshot the next chunk starts from
    resume_hints: list[int] = field(default_factory=list)  # prompt positions worth a resume point
    fetch_id: str | None = None  # a kvstore fetch of its resume point is in flight
    fetched: tuple[str, int] | None = None  # (fetch id, position): fetched state held by the worker
    fetch_failed: bool = False  # the kvstore could not serve it: recompute
    constraint: Constraint | None = None  # structured output, enforced by the worker
    constraint_sent: bool = False  # the worker holds its matcher (sent with a chunk since the last drop)
    mm: MultiModalInput | None = None  # its images: spans of the prompt, their digests, the family's payload
    cache_prompt: list[int] | None = None  # the prompt as the prefix cache keys it (``mm.cache_tokens``)
    # prefill/decode disaggregation (``engine.handoff``): hand off at this output length (0: never); the position whose
    # state was exported (None: not handed off; 0: the export failed); the position a prefill replica exported for it
    handoff_at: int = 0
    handoff_position: int | None = None
    resume_position: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (a chunk's tokens: its cost follows the
        chunk, not the sequence before it)."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def cache_token_ids(self) -> list[int]:
        """The tokens the prefix cache keys on: image-span positions keyed by their image's digest."""
        prompt = self.prompt_token_ids if self.cache_prompt is None else self.cache_prompt
        return prompt + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """The model's rules for a new request, checked once where it enters the system (``LLMEngine.add_request`` in
    process, the balancer in the mesh): a prompt of at least one token, every id in the vocabulary, the sampling
    parameters' model-dependent rules (``SamplingParams.validate_for_model``; their field rules hold from
    construction). Raises ValueError naming the field."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if not prompt_token_ids:
        raise ValueError("prompt: empty prompt (at least one token is required)")
    bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids: {len(bad)} token ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]!r}"
        )
    params.validate_for_model(vocab_size)


def check_admission(
    prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], params: SamplingParams, max_model_len: int,
    max_len: int, pages_needed: int, pages_total: int, page_size: int,
) -> None:  # fmt: skip
    """A replica's own limits for a new request (``Scheduler.add``): ``max_len`` is the longest a sequence may grow
    there, ``pages_needed`` what its prompt and one token take of the ``pages_total`` pages. Raises ValueError."""
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens; the model's limit is {max_model_len} "
            "tokens including at least one generated token"
        )
    if pages_needed > pages_total:
        raise ValueError(f"prompt needs more KV pages than the cache holds ({pages_total} pages of {page_size} tokens)")
    total = len(prompt_token_ids) + len(output_token_ids)
    if output_token_ids and total >= max_len:
        raise ValueError(f"output_token_ids: {total} tokens with the prompt; the limit is {max_len}")
    if output_token_ids and params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
        raise ValueError(f"output_token_ids: {len(output_token_ids)} tokens; max_tokens is {params.max_tokens}")
