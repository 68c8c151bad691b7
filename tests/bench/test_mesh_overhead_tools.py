"""``bench/serving/mesh_overhead.py``'s reading of the services' /metrics: step phases and graph captures, from a real
``WorkerMetrics`` registry served over HTTP on loopback."""

from __future__ import annotations

from types import SimpleNamespace

from bench.serving.mesh_overhead import phase_totals, phase_use
from deepinfer.serving.healthcheck import free_port
from deepinfer.serving.metrics import WorkerMetrics, start_metrics_server


def test_a_run_reports_its_phases_and_the_graphs_captured_during_it() -> None:
    metrics, port = WorkerMetrics("m"), free_port("127.0.0.1")
    stop = start_metrics_server(metrics.registry, "127.0.0.1", port)
    try:
        mesh = SimpleNamespace(endpoints={"worker-0 metrics": f"http://127.0.0.1:{port}/metrics"})
        metrics.phase("launch", 0.002)
        metrics.step(0.01, 5, graph_captures=1)  # (the warm-up's capture: before the run)
        before = phase_totals(mesh)
        for _ in range(3):
            metrics.phase("launch", 0.004)
        metrics.step(0.01, 5, graph_captures=2)  # a step met a batch size the warm-up had not captured
        use = phase_use(before, phase_totals(mesh))
    finally:
        stop()
    assert use["worker-0 launch"] == {"n": 3, "mean_ms": 4.0}
    assert use["worker-0 graph captures"] == {"n": 2}


def test_a_run_reports_the_resume_points_offloaded_to_the_kvstore_in_it() -> None:
    """Puts only (a get is no offload), over both paths (a stream, a file of the shared directory)."""
    from prometheus_client import CollectorRegistry

    from services.kvstore.metrics import KVStoreMetrics

    registry, port = CollectorRegistry(), free_port("127.0.0.1")
    metrics = KVStoreMetrics(registry)
    stop = start_metrics_server(registry, "127.0.0.1", port)
    try:
        mesh = SimpleNamespace(endpoints={"kvstore metrics": f"http://127.0.0.1:{port}/metrics"})
        metrics.transfers.labels("put", "stream").inc()  # (before the run)
        before = phase_totals(mesh)
        metrics.transfers.labels("put", "stream").inc(2)
        metrics.transfers.labels("put", "shared").inc()
        metrics.transfers.labels("get", "stream").inc(5)
        use = phase_use(before, phase_totals(mesh))
    finally:
        stop()
    assert use == {"kvstore puts": {"n": 3}}
