"""``bench/admission.py --tiny --device cpu``: the admission benchmark's smoke mode, so that it never rots. A real
balancer in front of a full replica: every request of the burst refused (429 + Retry-After / RESOURCE_EXHAUSTED)
by the balancer's gate, none reaching the replica; the bare stacks measured beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_admission_smoke_mode_refuses_every_request_at_the_gate(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    out = tmp_path / "admission.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "admission.py"), "--tiny", "--device", "cpu", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["replica_submits"] == 1  # only the request that holds the place reached the replica
    for who in ("ours", "bare"):
        for kind in ("http", "grpc"):
            r = result[who][kind]
            assert r["refused"] == r["requests"] == 200 and not r["not_refused"], (who, kind, r)
            assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] and r["server_cpu_us_per_request"] > 0
    assert "| http | deepinfer balancer |" in run.stdout and "bare stack (peer)" in run.stdout
