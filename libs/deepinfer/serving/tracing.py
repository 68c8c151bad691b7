"""Tracing across the services: W3C trace context in gRPC metadata, GenAI span attributes (PRACTICES §C4).

The balancer starts one SERVER span per request (``chat <model>`` / ``text_completion <model>``) and sends
its context with ``Scheduler.Submit`` (:func:`inject_metadata`); the scheduler continues the trace
(:func:`extract_metadata`) with the request's ``queue``, ``prefill`` and ``decode`` spans. Spans go to the
tracer provider that ``deepinfer.telemetry.configure_tracing`` installs (nowhere when none is configured).
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from deepinfer.v1 import common_pb2

__all__ = ["extract_metadata", "inject_metadata", "request_attributes", "tracer"]


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
