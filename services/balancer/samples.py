"""``n`` samples of one gRPC ``Generate`` request, as the OpenAI front end runs them (:mod:`.http_choices`).

The request runs as ``n`` generation requests (:func:`~.http_choices.sample_requests`: sample ``i`` under the id
``{id}-{i}``, seeded ``(seed + i) mod 2**64``). The first one goes alone, keeping a prefix-cache resume point one
token short of the prompt's end; once it has produced its first message the others go to its replica (while that one
is routable), where they resume from that point. Their messages are relayed as they come, each under the request's
id with its sample's ``index``; each sample ends with its own ``finished`` (its own usage).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from deepinfer.v1 import generation_pb2
from services.balancer.http_choices import merge, sample_requests
from services.balancer.openai_protocol import MAX_N

Open = Callable[..., AsyncIterator[generation_pb2.GenerateResponse]]


def check_n(request: generation_pb2.GenerateRequest) -> int:
    """The request's sample count (0 means 1); ValueError naming ``n`` outside [1, ``MAX_N``]."""
    n = request.n or 1
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n: an integer in [1, {MAX_N}], got {request.n}")
    return n


async def _indexed(
    i: int, rid: str, stream: AsyncIterator[generation_pb2.GenerateResponse],
    first: generation_pb2.GenerateResponse | None = None,
) -> AsyncIterator[generation_pb2.GenerateResponse]:  # fmt: skip
    """``stream``'s messages (after ``first``, if given) under the request's id and the sample's index."""
    try:
        if first is not None:
            first.request_id, first.index = rid, i
            yield first
        async for out in stream:
            out.request_id, out.index = rid, i
            yield out
    finally:
        await stream.aclose()


async def generate_samples(
    request: generation_pb2.GenerateRequest, n: int, open_: Open, replica_of: Callable[[str], str | None],
    timeout: float | None = None,
) -> AsyncIterator[generation_pb2.GenerateResponse]:  # fmt: skip
    """The interleaved messages of ``n`` > 1 samples. ``open_(sample, timeout, prefer=..., shared=...)`` starts one
    sample's stream (the balancer's ``generate``, observed); ``replica_of(id)``: where a running sample runs."""
    rid = request.request_id or f"gen-{uuid.uuid4().hex}"
    base = generation_pb2.GenerateRequest()
    base.CopyFrom(request)
    base.request_id, base.n = rid, 0
    samples = sample_requests(base, n)
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    first_stream = open_(samples[0], left(), shared=True)
    try:
        first = await anext(first_stream)  # errors before anything was sent (a bad request) surface here
    except BaseException:
        await first_stream.aclose()
        raise
    prefer = replica_of(samples[0].request_id)
    gens = [_indexed(0, rid, first_stream, first)]
    gens += [_indexed(i, rid, open_(s, left(), prefer=prefer)) for i, s in enumerate(samples[1:], 1)]
    async for out in merge(gens):  # type: ignore[arg-type]
        yield out


__all__ = ["check_n", "generate_samples"]
