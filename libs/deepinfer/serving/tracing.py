"""Tracing across the services: W3C trace context in gRPC metadata, span attributes after OpenTelemetry's
semantic conventions for generative AI (``gen_ai.*``).

The balancer starts one SERVER span per request (``chat <model>`` / ``text_completion <model>``) and sends
its context with ``Scheduler.Submit`` (:func:`inject_metadata`); the scheduler continues the trace
(:func:`extract_metadata`) with the request's ``queue``, ``prefill`` and ``decode`` spans, and sends the
context on to the worker with the request's first chunk. The worker (:class:`StepTraces`) records one ``step``
span per batch (a root, linked to the traces of the requests it serves) and, when spans are exported, one
``forward`` span per request and step, a child of the request's span: so each request's trace shows every
step that ran its tokens. Spans go to the tracer provider that ``deepinfer.telemetry.configure_tracing``
installs (nowhere when none is configured).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from deepinfer.v1 import common_pb2

if TYPE_CHECKING:
    from deepinfer.engine.interfaces import WorkerStepPlan

__all__ = [
    "RequestTrace",
    "StepSpans",
    "StepTraces",
    "extract_metadata",
    "inject_metadata",
    "request_attributes",
    "tracer",
]


def tracer(name: str) -> trace.Tracer:
    """A tracer of the global provider (resolved lazily, so it may be taken before tracing is configured)."""
    return trace.get_tracer(name)


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the trace context of ``context`` (default: the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def extract_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context sent in gRPC ``metadata`` (an empty context when there is none)."""
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    return propagate.extract(carrier)


def request_attributes(operation: str, model: str, sampling: common_pb2.SamplingParams) -> dict[str, AttributeValue]:
    """The ``gen_ai.*`` request attributes of a generation request."""
    attrs: dict[str, AttributeValue] = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
    if sampling.HasField("max_tokens"):
        attrs["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.HasField("temperature"):
        attrs["gen_ai.request.temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        attrs["gen_ai.request.top_p"] = sampling.top_p
    if sampling.top_k:
        attrs["gen_ai.request.top_k"] = sampling.top_k
    if sampling.HasField("seed"):
        attrs["gen_ai.request.seed"] = sampling.seed
    return attrs


_tracer = trace.get_tracer("deepinfer.scheduler")


@dataclass
class RequestTrace:
    """When a request passed its phases (``time.time_ns``), for its ``queue``/``prefill``/``decode`` spans."""

    parent: Context
    admitted: int
    scheduled: int | None = None
    first_token: int | None = None
    output_tokens: int = 0
    finished: int | None = None  # when the last event was sent (else: when the stream ended)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    miss_reason: str | None = None  # why the prefix cache served nothing

    @property
    def carrier(self) -> dict[str, str]:
        """The W3C carrier of the request's trace, for the worker's span links and ``forward`` spans."""
        out: dict[str, str] = {}
        propagate.inject(out, context=self.parent)
        return out

    def record(self, request_id: str, prompt_tokens: int, outcome: str) -> None:
        """Emit the spans of the phases the request reached (children of the balancer's request span)."""
        end = self.finished or time.time_ns()
        attrs = {"deepinfer.request_id": request_id}
        phases = [("queue", self.admitted, self.scheduled or end, {})]
        if self.scheduled is not None:
            prefill = {
                "gen_ai.usage.input_tokens": prompt_tokens,
                "deepinfer.prefix_cache.cached_tokens": self.cached_tokens,
            }
            if self.miss_reason:
                prefill["deepinfer.prefix_cache.miss_reason"] = self.miss_reason
            phases.append(("prefill", self.scheduled, self.first_token or end, prefill))
        if self.first_token is not None:
            phases.append(("decode", self.first_token, end, {"gen_ai.usage.output_tokens": self.output_tokens}))
        for name, start, stop, extra in phases:
            span = _tracer.start_span(name, context=self.parent, start_time=start, attributes={**attrs, **extra})
            if stop == end:
                span.set_attribute("deepinfer.outcome", outcome)
            span.end(end_time=stop)


@dataclass
class _Traced:
    link: trace.Link  # to the request's span, from each batch step that serves it
    context: Context | None  # the request's context, when its steps get spans of their own (sampled, exported)


@dataclass
class StepSpans:
    """The spans of one launched step: the batch ``step`` span and the requests' ``forward`` spans."""

    step: trace.Span
    forwards: list[trace.Span] = field(default_factory=list)

    def end(self) -> None:
        now = time.time_ns()
        for s in self.forwards:
            s.end(end_time=now)
        self.step.end(end_time=now)


class StepTraces:
    """The worker's spans of one ``Step`` stream.

    Each step is one ``step`` span (a trace of its own: a batch serves many requests, and a span has one parent)
    linked to the trace of every request it serves. With ``per_request`` (default: when this process exports
    spans, :func:`deepinfer.telemetry.tracing_exported`) every request whose trace is sampled also gets, per step
    that runs its tokens, a ``forward`` span under its own request span (linked back to the batch's ``step``
    span): each request's trace then holds its steps, at the cost of one span per request and step, made only
    for traced requests."""

    def __init__(self, tracer_: trace.Tracer, per_request: bool | None = None) -> None:
        if per_request is None:
            from deepinfer.telemetry import tracing_exported

            per_request = tracing_exported()
        self.tracer, self.per_request = tracer_, per_request
        self.requests: dict[str, _Traced] = {}

    def note(self, plan: WorkerStepPlan) -> None:
        """Forget the plan's released requests; remember the trace contexts its chunks carry (first chunks)."""
        for rid in plan.released:
            self.requests.pop(rid, None)
        for c in plan.chunks:
            if c.trace_context:
                ctx = propagate.extract(c.trace_context)
                sc = trace.get_current_span(ctx).get_span_context()
                own = self.per_request and sc.is_valid and sc.trace_flags.sampled
                self.requests[c.request_id] = _Traced(trace.Link(sc), ctx if own else None)

    def start(self, plan: WorkerStepPlan) -> StepSpans:
        """Start the spans of ``plan``'s step (end them with :meth:`StepSpans.end` when it finishes)."""
        served = [(c, self.requests.get(c.request_id)) for c in plan.chunks]
        step = self.tracer.start_span("step", links=[t.link for _, t in served if t is not None], attributes={
            "deepinfer.step_id": plan.step_id,
            "deepinfer.step.num_tokens": plan.num_tokens,
            "deepinfer.step.num_seqs": len(plan.chunks),
        })  # fmt: skip
        spans = StepSpans(step)
        if not self.per_request:
            return spans
        back = [trace.Link(step.get_span_context())]
        for c, t in served:
            if t is not None and t.context is not None:
                spans.forwards.append(self.tracer.start_span("forward", context=t.context, links=back, attributes={
                    "deepinfer.request_id": c.request_id,
                    "deepinfer.step_id": plan.step_id,
                    "deepinfer.step.num_tokens": len(c.token_ids),
                    "deepinfer.step.num_seqs": len(plan.chunks),
                }))  # fmt: skip
        return spans
