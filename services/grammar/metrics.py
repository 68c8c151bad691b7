"""Prometheus metrics of the grammar service, in a private registry (served on ``--metrics-port``).

==============================================  ===============  ==============================================
name                                            labels           meaning
==============================================  ===============  ==============================================
``deepinfer_grammar_compiles_total``            kind, outcome,   Compile requests by outcome: ok, invalid,
                                                backend          limit (refused before compiling), timeout,
                                                                 crash (compile process died / out of memory)
``deepinfer_grammar_cache_hits_total``          kind             requests served from the compile cache
``deepinfer_grammar_compile_seconds``           kind, cached,    request latency in the service (histogram)
                                                backend
``deepinfer_grammar_cache_bytes``                                bytes held by the compile cache
``deepinfer_grammar_cache_entries``                              grammars held by the compile cache
``deepinfer_grammar_processes``                 state            compile processes: alive, idle
``deepinfer_grammar_process_restarts_total``    reason           compile processes replaced: timeout, crash, ...
==============================================  ===============  ==============================================

``backend``: the engine of the compiled grammar (``xgrammar`` or ``llguidance``); for a refused compile the one
``DEEPINFER_GRAMMAR_BACKEND`` routes its kind to (``auto``: xgrammar, then llguidance, both refused).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deepinfer.grammar.spec import BACKENDS, KINDS, OUTCOMES
from services.grammar.pool import CompilerPool

__all__ = ["GrammarMetrics"]

COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESTART_REASONS = ("timeout", "crash", "start failed", "cancelled")


class GrammarMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        p = "deepinfer_grammar"
        self.compiles = Counter(f"{p}_compiles", "Compile requests by kind, outcome and backend.",
                                ["kind", "outcome", "backend"], registry=r)  # fmt: skip
        self.cache_hits = Counter(f"{p}_cache_hits", "Compile requests served from the cache.", ["kind"], registry=r)
        self.seconds = Histogram(f"{p}_compile_seconds", "Compile request latency in the service.",
                                 ["kind", "cached", "backend"], buckets=COMPILE_BUCKETS, registry=r)  # fmt: skip
        self.cache_bytes = Gauge(f"{p}_cache_bytes", "Bytes held by the compile cache.", registry=r)
        self.cache_entries = Gauge(f"{p}_cache_entries", "Grammars held by the compile cache.", registry=r)
        self.processes = Gauge(f"{p}_processes", "Compile processes by state (alive, idle).", ["state"], registry=r)
        self.restarts = Counter(f"{p}_process_restarts", "Compile processes replaced, by reason.", ["reason"],
                                registry=r)  # fmt: skip
        for kind in KINDS:  # exported at 0 from the start
            self.cache_hits.labels(kind)
            for outcome in OUTCOMES:
                for backend in BACKENDS:
                    self.compiles.labels(kind, outcome, backend)
        for reason in RESTART_REASONS:
            self.restarts.labels(reason)

    def bind(self, pool: CompilerPool) -> None:
        """Read the cache and process gauges from ``pool`` at scrape time; count its restarts."""
        self.cache_bytes.set_function(lambda: pool.cache.used_bytes)
        self.cache_entries.set_function(lambda: len(pool.cache))
        self.processes.labels("alive").set_function(lambda: pool.alive)
        self.processes.labels("idle").set_function(lambda: pool.idle)
        pool.on_restart = lambda reason: self.restarts.labels(reason).inc()

    def record(self, kind: str, outcome: str, seconds: float, cached: bool, backend: str = "xgrammar") -> None:
        kind = kind if kind in KINDS else "unknown"
        self.compiles.labels(kind, outcome, backend).inc()
        if cached:
            self.cache_hits.labels(kind).inc()
        self.seconds.labels(kind, "true" if cached else "false", backend).observe(seconds)
