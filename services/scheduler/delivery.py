"""What a step's result delivers to the scheduler service's streams: one ``TokenEvent`` per request.

An event carries the tokens the scheduler kept (``Scheduler.update``): with speculative decoding a result may hold
several tokens of a request (its token and the drafts it accepted), and the scheduler drops those after a stop token,
EOS or ``max_tokens``; a token the worker failed on (``SeqResult.error``) is not kept either. So the tokens delivered
are the request's output beyond its length before the result was applied (:func:`output_lengths`).
"""

from __future__ import annotations

import time

from deepinfer.engine.interfaces import SeqResult, StepResult
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.serving.tracing import RequestTrace
from deepinfer.v1 import common_pb2, scheduler_pb2

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def output_lengths(scheduler: Scheduler, result: StepResult) -> dict[str, int]:
    """The output length of each request the result names, before the result is applied."""
    lengths: dict[str, int] = {}
    for r in result.results:
        req = scheduler.requests.get(r.request_id)
        if req is not None:
            lengths[r.request_id] = len(req.output_token_ids)
    return lengths


def _kept(scheduler: Scheduler, r: SeqResult, before: dict[str, int]) -> int:
    """How many of the result's tokens the scheduler kept (a prefix of ``r.token_ids``)."""
    req = scheduler.requests.get(r.request_id)
    if req is None or r.request_id not in before:
        return 0
    return max(0, min(len(r.token_ids), len(req.output_token_ids) - before[r.request_id]))


def _add_tokens(ev: scheduler_pb2.TokenEvent, r: SeqResult, n: int) -> None:
    lps = [r.logprob, *r.extra_logprobs]
    tops = [r.top_logprobs, *r.extra_top_logprobs]
    for k, token in enumerate(r.token_ids[:n]):
        ev.token_ids.append(token)
        lp = ev.logprobs.add(token_id=token, logprob=(lps[k] if k < len(lps) else None) or 0.0)
        for t, v in (tops[k] if k < len(tops) else None) or []:
            lp.top.add(token_id=t, logprob=v)


def token_events(
    scheduler: Scheduler,
    result: StepResult,
    before: dict[str, int],
    finished: list[Request],
    traces: dict[str, RequestTrace],
) -> tuple[dict[str, scheduler_pb2.TokenEvent], dict[str, Request]]:
    """The events of a step's result (``before``: :func:`output_lengths` taken before it was applied) and the
    requests it finished, popped from the scheduler (by id)."""
    events: dict[str, scheduler_pb2.TokenEvent] = {}
    done: dict[str, Request] = {}
    now = time.time_ns() if traces else 0
    for r in result.results:
        n = _kept(scheduler, r, before) if r.token_id is not None else 0
        t = traces.get(r.request_id)
        if t is not None and n:
            t.first_token = t.first_token or now
            t.output_tokens += n
        ev = events.setdefault(r.request_id, scheduler_pb2.TokenEvent(request_id=r.request_id))
        _add_tokens(ev, r, n)
        req = scheduler.requests.get(r.request_id)
        if n and req is not None:  # the counts so far: a stop string may end the request at the balancer first
            ev.draft_tokens, ev.accepted_draft_tokens = req.num_draft_tokens, req.num_accepted_tokens
        for row in r.prompt_logprobs or []:
            entry = ev.prompt_logprobs.add()
            entry.entries.extend(common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in row.items())
    for req in finished:
        ev = events.setdefault(req.request_id, scheduler_pb2.TokenEvent(request_id=req.request_id))
        if req.finish_reason == "handoff":  # the stream ends without a finish reason: it goes on elsewhere
            ev.handoff.position = req.handoff_position or 0
        else:
            ev.finish_reason = FINISH[req.finish_reason or "stop"]
        ev.cached_tokens = req.num_cached_tokens
        ev.cached_tier = req.cache_tier or ""
        ev.draft_tokens, ev.accepted_draft_tokens = req.num_draft_tokens, req.num_accepted_tokens
        t = traces.get(req.request_id)
        if t is not None:
            t.cached_tokens, t.miss_reason = req.num_cached_tokens, req.cache_miss_reason
        if isinstance(req.stop_reason, int):
            ev.stop_token_id = req.stop_reason
        done[req.request_id] = scheduler.pop_finished(req.request_id)
    for rid, ev in events.items():
        req = scheduler.requests.get(rid) or done.get(rid)
        ev.prompt_tokens = req.num_prompt_tokens if req is not None else 0
    return events, done


__all__ = ["FINISH", "output_lengths", "token_events"]
