"""The README's performance figures are the ones bench/results/latest.json holds, and each of those is what its
committed result file says (``bench/figures.py check``, run as a process, as CI runs it); a figure changed on either
side, or one whose file says otherwise, is caught."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "bench" / "figures.py"


def figures(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    return subprocess.run([sys.executable, str(FIGURES), *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_readme_and_latest_json_agree_with_the_result_files() -> None:
    run = figures("check")
    assert run.returncode == 0, run.stdout + run.stderr
    latest = json.loads((ROOT / "bench" / "results" / "latest.json").read_text())
    wanted = {"model_decode_x_roofline": {"1", "64"}, "prefill_fraction_fp8": {"4096", "16384"}}
    for figure, keys in wanted.items():
        assert keys <= set(latest[figure]), figure
        for e in latest[figure].values():
            assert {"value", "date", "commit", "machine", "file", "source"} <= set(e)


def test_a_figure_that_its_file_does_not_say_is_caught(tmp_path: Path) -> None:
    latest = json.loads((ROOT / "bench" / "results" / "latest.json").read_text())
    latest["prefill_fraction_fp8"]["4096"]["value"] = 0.35
    (tmp_path / "latest.json").write_text(json.dumps(latest))
    run = figures("check", "--latest", str(tmp_path / "latest.json"))
    assert run.returncode == 1 and "prefill_fraction_fp8/4096" in run.stderr, run.stderr


def test_a_readme_figure_edited_by_hand_is_caught(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    text = readme.read_text()
    figure = re.search(r"at (\d+\.\d+)x", text)
    assert figure is not None
    readme.write_text(text.replace(figure[0], "at 9.99x", 1))
    run = figures("check", "--readme", str(readme))
    assert run.returncode == 1 and "render --write" in run.stderr, run.stderr


def test_smoke_mode(tmp_path: Path) -> None:
    run = figures("--tiny", "--device", "cpu", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "figures in latest.json: ok" in run.stdout and (tmp_path / "figures.md").read_text().startswith("- ")
