"""Prometheus metrics of the balancer, the scheduler and the worker, under vLLM-compatible names where one
exists (``vllm:*``: dashboards made for vLLM work unchanged). Each service has its own private registry; the
scheduler and the worker serve theirs on ``--metrics-port`` (:func:`start_metrics_server`), the balancer on its
HTTP API's ``/metrics``.

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
import sys
import time
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from deepinfer.v1 import common_pb2, generation_pb2

__all__ = [
    "CONTENT_TYPE_LATEST",
    "METRICS",
    "Metrics",
    "SchedulerMetrics",
    "WorkerMetrics",
    "finish_reason_name",
    "observe_stream",
    "start_metrics_server",
    "status_label",
]

# vLLM v1's buckets, so that existing dashboards read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PHASE_BUCKETS = (5e-5, 1e-4, 2e-4, 4e-4, 7e-4, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


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
        self.routes = Counter(
            "deepinfer_balancer_routes", "Requests sent to a replica, by what chose it (docs/routing.md): cache (a "
            "replica's prefix cache holds part of the prompt), session (the replica of the request's session), load "
            "(the fewest requests in flight), prefer (the replica of the request's other samples), round_robin "
            "(DEEPINFER_ROUTER_POLICY=round_robin).",
            [*model, "reason"], registry=r,
        )  # fmt: skip
        self.cache_index = Gauge(
            "deepinfer_balancer_cache_index_entries", "Resume points the balancer knows a replica holds (its "
            "cache-aware routing's index, from the replicas' KV events).", [*model, "replica"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "deepinfer_balancer_migrations",
            "Requests moved to another replica after theirs failed mid-stream, by how the new replica rebuilt their "
            "state (kvstore: from a resume point the kvstore held; device: from one on its device; recompute).",
            [*model, "source"], registry=r,
        )  # fmt: skip
        self.replicas = Gauge(
            "deepinfer_balancer_replicas", "Replicas that serve now, by role (mixed, prefill, decode; unknown until "
            "a replica has answered its first probe).", [*model, "role"], registry=r,
        )  # fmt: skip
        self.handoffs = Counter(
            "deepinfer_balancer_handoffs",
            "Requests continued on another replica from the state theirs handed off (disaggregation's prefill to "
            "decode, a draining replica's, rebalancing's), by how the next replica got that state (kvstore: the "
            "export; recompute: the export or its fetch failed).", [*model, "source"], registry=r,
        )  # fmt: skip
        self.rebalanced = Counter(
            "deepinfer_balancer_rebalanced", "Running requests the balancer moved from its busiest decoding replica "
            "to its idlest (counted when they hand off), their state through the kvstore "
            "(DEEPINFER_REBALANCE_INTERVAL_S).", model, registry=r,
        )  # fmt: skip

    def count_request(self, model: str, route: str, status: str) -> None:
        """Count a request that ended before its stream started (bad JSON, unknown model, ...)."""
        self.requests.labels(model, route, status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = Metrics()


class SchedulerMetrics:
    """One scheduler replica's metrics (vLLM names for the gauges and counters dashboards already read)."""

    # failed: the engine failed the request (its grammar failed on the worker: the stream ends with INTERNAL)
    OUTCOMES = ("finished", "aborted", "rejected", "failed", "handed_off")

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).", labels, registry=r
        )
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (recomputed).", labels, registry=r)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step.", labels,
            buckets=ITERATION_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "deepinfer_scheduler_step_seconds", "Time from sending a step to the worker to its result.", labels,
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_phase_seconds = Histogram(
            "deepinfer_scheduler_step_phase_seconds",
            "Host time of a step's phases: plan (schedule it and queue it for the worker), deliver (apply its "
            "result, hand each request its tokens).",
            [*labels, "phase"], buckets=PHASE_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "deepinfer_scheduler_requests", "Requests by outcome (finished, aborted, rejected, failed, handed_off).",
            [*labels, "outcome"], registry=r,
        )  # fmt: skip
        self.workers_lost = Counter(
            "deepinfer_scheduler_worker_lost", "Times the worker's step stream broke (its requests moved away).",
            labels, registry=r,
        )  # fmt: skip
        self.session_streams = Gauge(
            "deepinfer_scheduler_session_streams", "Session streams open (each carries many requests: a balancer's).",
            labels, registry=r,
        )  # fmt: skip
        for outcome in self.OUTCOMES:  # exported at 0 from the start
            self.requests.labels(model, outcome)
        self.session_streams.labels(model)
        self.preemptions.labels(model)
        self.workers_lost.labels(model)

    def bind(self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]) -> None:
        """Read the gauges from the scheduler at scrape time."""
        self.running.labels(self.model).set_function(running)
        self.waiting.labels(self.model).set_function(waiting)
        self.kv_usage.labels(self.model).set_function(kv_usage)

    def bind_scheduler(self, scheduler: object) -> None:
        """Read the scheduler's prefix-cache and speculative-decoding counters at scrape time."""
        from deepinfer.serving.collectors import PrefixCacheCollector, SpeculationCollector

        self.registry.register(PrefixCacheCollector(scheduler, self.model))
        self.registry.register(SpeculationCollector(scheduler, self.model))

    def session_stream(self, delta: int) -> None:
        self.session_streams.labels(self.model).inc(delta)

    def step(self, seconds: float, num_tokens: int, new_preemptions: int) -> None:
        self.step_seconds.labels(self.model).observe(seconds)
        self.iteration_tokens.labels(self.model).observe(num_tokens)
        if new_preemptions:
            self.preemptions.labels(self.model).inc(new_preemptions)

    def phase(self, phase: str, seconds: float) -> None:
        """One step's ``phase`` (plan, deliver) took ``seconds`` of the scheduler's host time."""
        self.step_phase_seconds.labels(self.model, phase).observe(seconds)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()

    def worker_lost(self) -> None:
        self.workers_lost.labels(self.model).inc()


class WorkerMetrics:
    """One worker's metrics: step time and tokens run."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        self.step_seconds = Histogram(
            "deepinfer_worker_step_seconds", "Time to run one step on the accelerator.", ["model_name"],
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_phase_seconds = Histogram(
            "deepinfer_worker_step_phase_seconds",
            "Host time of a step's phases: launch, finish (collect the tokens, build the result), starved (no step on "
            "the device and no plan to launch), idle (starved a second or more).",
            ["model_name", "phase"], buckets=PHASE_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter("deepinfer_worker_tokens", "Tokens run (prefill and decode).", ["model_name"], registry=r)
        self.tokens.labels(model)
        self.graph_captures = Counter(
            "deepinfer_worker_graph_captures",
            "CUDA graph buckets captured (warm-up included); each one while serving stalled the step that met a new "
            "batch size, draft count or context span once.", ["model_name"], registry=r,
        )  # fmt: skip
        self.graph_captures.labels(model)
        self.image_encodes = Counter(
            "deepinfer_worker_image_encodes", "Images run through the vision encoder.", ["model_name"], registry=r
        )
        self.image_cache_hits = Counter(
            "deepinfer_worker_image_cache_hits", "Images whose features came from the feature cache.", ["model_name"],
            registry=r,
        )  # fmt: skip
        self.image_cache_bytes = Gauge(
            "deepinfer_worker_image_cache_bytes", "Bytes of encoded image features cached.", ["model_name"], registry=r
        )
        self.image_held_bytes = Gauge(
            "deepinfer_worker_image_features_held_bytes", "Bytes of image features that requests in flight hold.",
            ["model_name"], registry=r,
        )  # fmt: skip
        for m in (self.image_encodes, self.image_cache_hits, self.image_cache_bytes, self.image_held_bytes):
            m.labels(model)
        self.pinned_bytes = Gauge(
            "deepinfer_worker_pinned_pool_bytes", "The pinned pool's bytes (DEEPINFER_PINNED_POOL_BYTES): reserved, "
            "in_use (snapshots and pages held in host memory), peak.", ["model_name", "state"], registry=r,
        )  # fmt: skip
        self.pinned_fallbacks = Counter(
            "deepinfer_worker_pinned_pool_fallbacks", "Host copies the pinned pool had no room for (each took a block "
            "of PyTorch's caching host allocator: a fresh pinned allocation when none of its size was cached).",
            ["model_name"], registry=r,
        )  # fmt: skip
        self.pinned_fallbacks.labels(model)
        self._fallbacks_seen = 0

    def step(self, seconds: float, num_tokens: int, graph_captures: int = 0) -> None:
        self.step_seconds.labels(self.model).observe(seconds)
        self.tokens.labels(self.model).inc(num_tokens)
        self.graph_captures.labels(self.model).inc(graph_captures)
        module = sys.modules.get("deepinfer.runtime.pinned_pool")  # (never imported here: no torch in this module)
        pool = module.current() if module is not None else None
        if pool is not None:
            for state, value in (("reserved", pool.nbytes), ("in_use", pool.in_use), ("peak", pool.peak)):
                self.pinned_bytes.labels(self.model, state).set(value)
            if pool.fallbacks > self._fallbacks_seen:
                self.pinned_fallbacks.labels(self.model).inc(pool.fallbacks - self._fallbacks_seen)
                self._fallbacks_seen = pool.fallbacks

    def phase(self, phase: str, seconds: float) -> None:
        """One step's ``phase`` (``serving.step_pipeline``: launch, finish, starved, idle) took ``seconds``."""
        self.step_phase_seconds.labels(self.model, phase).observe(seconds)

    def images(self, encodes: int, hits: int, cache_bytes: int, held_bytes: int) -> None:
        """A request's images were prepared: ``encodes`` ran the encoder, ``hits`` came from the cache."""
        self.image_encodes.labels(self.model).inc(encodes)
        self.image_cache_hits.labels(self.model).inc(hits)
        self.image_cache_bytes.labels(self.model).set(cache_bytes)
        self.image_held_bytes.labels(self.model).set(held_bytes)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> Callable[[], None]:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread; returns its ``stop``."""
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


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
