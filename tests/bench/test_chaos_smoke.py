"""``bench/chaos.py --tiny --device cpu``: the chaos benchmark's smoke mode, so that it never rots, and a short
chaos run of its own: services killed under load, no request lost, every output token-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def test_chaos_smoke_mode_loses_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT / "tests"), str(ROOT)])
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--tiny", "--device", "cpu", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    chaos = result["chaos"]
    assert result["kills"], "nothing was killed"
    assert chaos["completed"] > 0 and chaos["failed"] == 0, chaos
    assert chaos["exact"] == chaos["completed"], chaos
    assert "token-exact" in run.stdout
