"""Prometheus metrics of the balancer, under vLLM-compatible names where one exists (PRACTICES §C3).

Per-replica gauges (``vllm:num_requests_running`` ...) belong to the schedulers; the balancer records what
it sees of each request stream. Both front ends record through ``observe_stream``::

    async for out in observe_stream(service.generate(request), model=info.model, route="/v1/completions"):
        ...

The ``status`` label of ``deepinfer_balancer_requests_total`` is the outcome as a lower-case gRPC status
name (``ok``, ``invalid_argument``, ``not_found``, ``resource_exhausted``, ``unavailable``,
``deadline_exceeded``, ``cancelled``, ``internal``), for the gRPC and the HTTP front end alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deepinfer.v1 import common_pb2, generation_pb2

__all__ = ["CONTENT_TYPE_LATEST", "METRICS", "Metrics", "finish_reason_name", "observe_stream", "status_label"]

# vLLM v1's buckets, so that existing dashboards read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics:
    """The balancer's metrics in a private registry (``render()`` is the ``/metrics`` body)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        model = ["model_name"]
        self.requests = Counter(
            "deepinfer_balancer_requests", "Generation requests by route and outcome.",
            [*model, "route", "status"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "deepinfer_balancer_requests_in_flight", "Generation streams open on the balancer.", model, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to the first generated token.", model,
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive token messages.", model,
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to the last token.", model,
            buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", model, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", model, registry=r)
        self.success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", [*model, "finished_reason"], registry=r
        )

    def count_request(self, model: str, route: str, status: str) -> None:
        """Count a request that ended before its stream started (bad JSON, unknown model, ...)."""
        self.requests.labels(model, route, status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = Metrics()


def finish_reason_name(reason: int) -> str:
    """``FINISH_REASON_STOP`` -> ``"stop"`` (``length``, ``abort``, ``error``)."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def status_label(exc: BaseException | None) -> str:
    """The outcome label of a request that raised ``exc`` (None: it succeeded)."""
    if exc is None:
        return "ok"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name.lower()
    if isinstance(exc, ValueError):
        return "invalid_argument"
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return "cancelled"
    code = getattr(exc, "grpc_status", None)  # an HTTP-layer error that knows its status
    return code.name.lower() if isinstance(code, grpc.StatusCode) else "internal"


async def observe_stream(
    stream: AsyncIterator[generation_pb2.GenerateResponse],
    *,
    model: str,
    route: str,
    metrics: Metrics | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """Pass ``stream`` through, recording latency, token and outcome metrics; closing it closes ``stream``."""
    m = metrics or METRICS
    start, last = clock(), None
    status, finished = "internal", False
    m.in_flight.labels(model).inc()
    try:
        async for out in stream:
            now = clock()
            if out.prompt_tokens:
                m.prompt_tokens.labels(model).inc(out.prompt_tokens)
            if out.token_ids:
                (m.ttft if last is None else m.itl).labels(model).observe(now - (start if last is None else last))
                last = now
            if out.HasField("finished"):
                finished = True
                m.generation_tokens.labels(model).inc(out.finished.usage.completion_tokens)
                m.success.labels(model, finish_reason_name(out.finished.reason)).inc()
                m.e2e.labels(model).observe(now - start)
            yield out
        status = "ok"
    except BaseException as e:
        status = "ok" if finished and isinstance(e, GeneratorExit) else status_label(e)
        raise
    finally:
        m.in_flight.labels(model).dec()
        m.requests.labels(model, route, status).inc()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
