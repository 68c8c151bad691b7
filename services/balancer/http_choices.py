"""The choices of one OpenAI response: ``n`` samples of a prompt, their usage summed, their events interleaved.

A request with ``n`` > 1 runs as ``n`` generation requests of its own (:func:`sample_requests`): sample ``i`` under
the id ``{id}-{i}`` and, when the request is seeded, with the seed ``(seed + i) mod 2**64`` (as vLLM derives its
samples' seeds), so the samples differ from each other and a seeded request repeats. The response has one choice
per sample (``index`` 0..n-1); its usage counts the prompt once (the first sample's prompt and cached tokens) and
the completion tokens of every sample. A stream interleaves the samples' chunks as they come (:func:`merge`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from deepinfer.v1 import common_pb2, generation_pb2

SEED_SPACE = 2**64  # the wire's seed is a uint64


def sample_requests(request: generation_pb2.GenerateRequest, n: int) -> list[generation_pb2.GenerateRequest]:
    """The ``n`` samples of ``request`` (``[request]`` itself when ``n`` is 1)."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        sample = generation_pb2.GenerateRequest()
        sample.CopyFrom(request)
        sample.request_id = f"{request.request_id}-{i}"
        if request.sampling.HasField("seed"):
            sample.sampling.seed = (request.sampling.seed + i) % SEED_SPACE
        out.append(sample)
    return out


async def collect(
    firsts: list[generation_pb2.GenerateResponse], streams: list[AsyncIterator[generation_pb2.GenerateResponse]]
) -> list[list[generation_pb2.GenerateResponse]]:
    """Every sample's responses, read side by side (no replica's stream waits on another's)."""

    async def rest(first: generation_pb2.GenerateResponse, stream: AsyncIterator) -> list:
        return [first] + [o async for o in stream]

    got = await asyncio.gather(*(rest(f, s) for f, s in zip(firsts, streams, strict=True)), return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got


async def merge(gens: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """The events of ``gens`` in the order they come (ties: by sample index); closes them all however it ends."""
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                yield event
                pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]


async def with_usage(
    include: bool, head: dict[str, Any], events: AsyncIterator[dict[str, Any]], usages: list[common_pb2.Usage],
    reasoning: list[int | None] | None = None,
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    """The samples' interleaved events, then (``include``: ``stream_options.include_usage``) one chunk with their
    summed usage."""
    async for event in events:
        yield event
    if include:
        yield head | {"choices": [], "usage": summed_usage(usages, reasoning)}


def usage(u: common_pb2.Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    details = {"cached_tokens": u.cached_tokens, "cached_tokens_by_tier": dict(u.cached_tokens_by_tier)}
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                           "total_tokens": u.total_tokens, "prompt_tokens_details": details}  # fmt: skip
    completion: dict[str, int] = {} if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    if u.draft_tokens > 0:  # speculative decoding, under OpenAI's predicted-output names
        completion["accepted_prediction_tokens"] = u.accepted_draft_tokens
        completion["rejected_prediction_tokens"] = u.draft_tokens - u.accepted_draft_tokens
    if completion:
        out["completion_tokens_details"] = completion
    return out


def summed_usage(usages: list[common_pb2.Usage], reasoning: list[int | None] | None = None) -> dict[str, Any]:
    """The usage of ``n`` samples: the prompt once (the first sample's), the completion tokens of all."""
    reasoning = reasoning or [None] * len(usages)
    first = common_pb2.Usage()
    first.CopyFrom(usages[0])
    first.draft_tokens = sum(u.draft_tokens for u in usages)
    first.accepted_draft_tokens = sum(u.accepted_draft_tokens for u in usages)
    out = usage(first, None if reasoning[0] is None else sum(r or 0 for r in reasoning))
    out["completion_tokens"] = sum(u.completion_tokens for u in usages)
    out["total_tokens"] = usages[0].prompt_tokens + out["completion_tokens"]
    return out


def openai_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parser fragments as chat-completion deltas: reasoning also under vLLM's ``reasoning`` name; adjacent
    text fragments of one kind merged."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if "reasoning_content" in d:
            d = {"reasoning_content": d["reasoning_content"], "reasoning": d["reasoning_content"]}
        if out and d.keys() == out[-1].keys() and "tool_calls" not in d:
            out[-1] = {k: out[-1][k] + d[k] for k in d}
        else:
            out.append(dict(d))
    return out


def text_choice(index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def tool_call(call: dict[str, str]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call}
