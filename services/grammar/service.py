"""The ``deepinfer.v1.Grammar`` gRPC servicer (a thin adapter over :class:`CompilerPool`) and the service's run loop.

Status codes (as in ``grammar.proto``): an invalid grammar, one over a limit, or one that crashed its compile
process → INVALID_ARGUMENT with the reason; a compile past its time limit → DEADLINE_EXCEEDED (the process is
replaced, the service keeps serving); a ``tokenizer_fingerprint`` other than the service's →
FAILED_PRECONDITION; no compile process can run → UNAVAILABLE; anything unexpected → INTERNAL with a generic
message. Every refusal is logged (``grammar_refused``) and counted; each request is one ``grammar compile``
span, a child of the caller's trace.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry import trace

from deepinfer import envs
from deepinfer.grammar.limits import Limits
from deepinfer.grammar.spec import CompiledGrammar, GrammarError, GrammarTimeout, GrammarUnavailable
from deepinfer.grammar.wire import grammar_to_proto, spec_from_proto
from deepinfer.serving.tracing import extract_metadata, tracer
from deepinfer.telemetry import get_logger
from deepinfer.v1 import grammar_pb2, grammar_pb2_grpc
from services.grammar.metrics import GrammarMetrics
from services.grammar.pool import CompilerPool

__all__ = ["GrammarConfig", "GrammarService", "run_grammar"]

log = get_logger(__name__)
_tracer = tracer("deepinfer.grammar")


@dataclass(frozen=True)
class GrammarConfig:
    """One grammar service's settings (``from_env``: the ``DEEPINFER_GRAMMAR_*`` variables)."""

    model_dir: Path | None = None
    workers: int = 2
    timeout_s: float = 10.0
    memory_bytes: int = 2 * 1024**3
    cache_bytes: int = 512 * 1024**2
    json_whitespace: int = 0
    json_indent: int = 0
    limits: Limits = Limits()
    backend: str = "auto"

    @classmethod
    def from_env(cls, model_dir: str | Path | None = None) -> GrammarConfig:
        return cls(
            model_dir=Path(model_dir).expanduser() if model_dir else None,
            workers=envs.DEEPINFER_GRAMMAR_WORKERS,
            timeout_s=envs.DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S,
            memory_bytes=envs.DEEPINFER_GRAMMAR_MEMORY_BYTES,
            cache_bytes=envs.DEEPINFER_GRAMMAR_CACHE_BYTES,
            json_whitespace=envs.DEEPINFER_GRAMMAR_JSON_WHITESPACE,
            json_indent=envs.DEEPINFER_GRAMMAR_JSON_INDENT,
            limits=Limits.from_env(),
            backend=envs.DEEPINFER_GRAMMAR_BACKEND,
        )

    def pool(self) -> CompilerPool:
        return CompilerPool(
            self.model_dir, workers=self.workers, timeout_s=self.timeout_s, memory_bytes=self.memory_bytes,
            cache_bytes=self.cache_bytes, limits=self.limits, json_whitespace=self.json_whitespace,
            json_indent=self.json_indent, backend=self.backend,
        )  # fmt: skip


class GrammarService(grammar_pb2_grpc.GrammarServicer):
    def __init__(self, pool: CompilerPool, metrics: GrammarMetrics, timeout_s: float) -> None:
        self.pool, self.metrics, self.timeout_s = pool, metrics, timeout_s

    def _time_limit(self, requested: float) -> float:
        if not math.isfinite(requested) or requested < 0:
            raise GrammarError(f"timeout_s: {requested} is not a number of seconds >= 0")
        return self.timeout_s if requested == 0 else min(requested, self.timeout_s)

    async def Compile(
        self, request: grammar_pb2.CompileRequest, context: grpc.aio.ServicerContext
    ) -> grammar_pb2.CompileResponse:
        t0 = time.perf_counter()
        schema = request.structured_output.schema
        kind, outcome, cached = "unknown", "ok", False
        grammar: CompiledGrammar | None = None
        status: tuple[grpc.StatusCode, str] | None = None
        parent = extract_metadata(context.invocation_metadata())
        with _tracer.start_as_current_span(
            "grammar compile", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"deepinfer.grammar.bytes": len(schema)},
        ) as span:  # fmt: skip
            try:
                spec = spec_from_proto(request.structured_output)
                kind = spec.kind
                span.set_attribute("deepinfer.grammar.kind", kind)
                limit = self._time_limit(request.timeout_s)
                fingerprint = request.tokenizer_fingerprint
                if fingerprint and fingerprint != self.pool.tokenizer_fingerprint:
                    outcome = "unavailable"
                    status = (grpc.StatusCode.FAILED_PRECONDITION,
                              f"tokenizer_fingerprint {fingerprint[:16]}... is not this grammar service's tokenizer "
                              f"({self.pool.tokenizer_fingerprint[:16]}...)")  # fmt: skip
                else:
                    grammar, cached = await self.pool.compile(spec, limit)
            except GrammarTimeout as e:
                outcome, status = "timeout", (grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
            except GrammarError as e:
                outcome, status = e.outcome, (grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except GrammarUnavailable as e:
                outcome, status = "unavailable", (grpc.StatusCode.UNAVAILABLE, str(e))
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            except Exception as e:
                log.exception("grammar_internal_error", error=repr(e))
                outcome, status = "crash", (grpc.StatusCode.INTERNAL, "internal error")
            finally:
                seconds = time.perf_counter() - t0
                span.set_attribute("deepinfer.grammar.outcome", outcome)
                span.set_attribute("deepinfer.grammar.cached", cached)
                backend = grammar.backend if grammar is not None else self.pool.route(kind)
                self.metrics.record(kind, outcome, seconds, cached, backend)
            if status is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, status[1]))
                log.info("grammar_refused", kind=kind, outcome=outcome, code=status[0].name, reason=status[1],
                         schema_bytes=len(schema), ms=round(seconds * 1e3, 3))  # fmt: skip
        if status is not None:
            await context.abort(*status)
        assert grammar is not None
        return grammar_pb2.CompileResponse(grammar=grammar_to_proto(grammar), compile_ms=seconds * 1e3, cached=cached)


async def run_grammar(
    config: GrammarConfig, host: str, port: int, metrics_port: int = 0, grace_s: float = 10.0
) -> None:
    """Start the compile processes, then serve ``deepinfer.v1.Grammar`` until SIGTERM (metrics, registry)."""
    from deepinfer.events import Registration
    from deepinfer.serving.metrics import start_metrics_server
    from deepinfer.serving.presence import Presence, advertised, instance_id
    from deepinfer.serving.server import Service, serve

    pool = config.pool()
    metrics = GrammarMetrics()
    metrics.bind(pool)
    me = instance_id("grammar")
    log.info("grammar_config", instance=me, model_dir=str(config.model_dir) if config.model_dir else None,
             tokenizer_fingerprint=pool.tokenizer_fingerprint, workers=config.workers, timeout_s=config.timeout_s,
             json_whitespace=config.json_whitespace, json_indent=config.json_indent, backend=config.backend,
             limits=vars(config.limits))  # fmt: skip
    await pool.start()  # SERVING only once compile processes are ready
    capacity = {"workers": config.workers, "timeout_s": config.timeout_s,
                "tokenizer_fingerprint": pool.tokenizer_fingerprint}  # fmt: skip
    presence = Presence(Registration(me, "grammar", advertised(host, port), capacity=capacity))
    stop_metrics = start_metrics_server(metrics.registry, host, metrics_port) if metrics_port > 0 else None

    async def started(_: object) -> None:
        await presence.start()

    servicer = GrammarService(pool, metrics, config.timeout_s)
    service = Service("deepinfer.v1.Grammar", servicer, grammar_pb2_grpc.add_GrammarServicer_to_server)
    try:
        await serve([service], host, port, grace_s=grace_s, on_started=started)
    finally:
        await presence.close()
        await pool.close()
        if stop_metrics is not None:
            stop_metrics()
