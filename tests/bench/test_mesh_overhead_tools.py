"""``bench/serving/mesh_overhead.py``'s reading of the services' /metrics: step phases and graph captures, from a real
``WorkerMetrics`` registry served over HTTP on loopback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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


def test_a_run_reports_the_host_copies_the_pinned_pool_had_no_room_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's metrics read the process's pool at each step: its bytes and the fallbacks since the last step."""
    from deepinfer.runtime import pinned_pool

    pool = pinned_pool.PinnedPool(2 * pinned_pool.ALIGN, pinned=False)
    monkeypatch.setattr(pinned_pool, "_POOL", pool)
    metrics, port = WorkerMetrics("m"), free_port("127.0.0.1")
    stop = start_metrics_server(metrics.registry, "127.0.0.1", port)
    try:
        mesh = SimpleNamespace(endpoints={"worker-0 metrics": f"http://127.0.0.1:{port}/metrics"})
        assert pool.empty((3 * pinned_pool.ALIGN,), torch.uint8) is None  # (before the run)
        metrics.step(0.01, 5)
        before = phase_totals(mesh)
        held = pool.empty((10,), torch.float32)
        assert held is not None and pool.empty((2 * pinned_pool.ALIGN,), torch.uint8) is None
        assert pool.empty((pinned_pool.ALIGN + 1,), torch.uint8) is None
        metrics.step(0.01, 5)
        use = phase_use(before, phase_totals(mesh))
        text = metrics.registry.get_sample_value
        in_use = text("deepinfer_worker_pinned_pool_bytes", {"model_name": "m", "state": "in_use"})
    finally:
        stop()
    assert use == {"worker-0 pinned fallbacks": {"n": 2}} and in_use == pinned_pool.ALIGN
