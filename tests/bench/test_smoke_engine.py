"""The `--tiny --device cpu` smoke mode of every benchmark in bench/engine/ (smoke_support.py says what is checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from smoke_support import BENCH, name, run_smoke, scripts


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", scripts("engine"), ids=name)
def test_smoke_mode(script: Path, tmp_path: Path) -> None:
    run_smoke(script, tmp_path)


@pytest.mark.timeout(600)
def test_speculative_smoke_on_v41(tmp_path: Path) -> None:
    """speculative.py's other model: V4.1 widths, DSpark drafting (one depth, one batch, one oracle rate), the verify
    steps' attention in one call per layer, and a prompt joining the timed run (``--mixed-ab``: its chunks beside
    verify rows, as two forwards and on the ragged path)."""
    flags = ("--model", "v41", "--depths", "4", "--batches", "1", "--errors", "1", "--tokens", "6")
    flags += ("--verify-attention", "fused", "--mixed-ab", "400", "--chunk", "160")  # (chunks past its 128-row rings)
    run_smoke(BENCH / "engine" / "speculative.py", tmp_path, flags, trim=False)  # (the V4 smoke profiles, A/Bs)
    (got,) = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("*.json")]
    mixed = got["rows"][0]["mixed"]
    assert mixed["split_steps"] > 0 and mixed["ragged"]["tpot_ms"] > 0, mixed
