"""``deepinfer bench serve`` against the real mesh (worker + scheduler + balancer processes on loopback), run as the
command a user runs: every backend completes its requests with the asked lengths, the summary's figures agree with
the requests', goodput follows the SLOs, multi-turn sessions carry the conversation, and an unreachable endpoint is
reported as failed requests, not a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.serving.healthcheck import free_port
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("bench_model"), seed=5)
    m = Mesh(model, tmp_path_factory.mktemp("bench_logs")).up(http=True)
    yield m
    m.down()


def bench(tmp: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)])}
    cmd = [sys.executable, "-m", "deepinfer", "bench", "serve", "--result-file", str(out), "--save-detailed", *flags]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    return run, json.loads(out.read_text()) if out.exists() else {}


def ordered(r: dict, name: str) -> bool:
    return r[f"p50_{name}_ms"] <= r[f"p90_{name}_ms"] <= r[f"p99_{name}_ms"]


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_token_id_prompts_complete_with_the_asked_lengths(mesh: Mesh, tmp_path: Path, backend: str) -> None:
    run, r = bench(
        tmp_path, "--backend", backend, "--base-url", mesh.http_url(), "--grpc-address", mesh.address("balancer"),
        "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--max-concurrency", "3",
        "--goodput", "ttft:600000 e2el:600000", "--plot", str(tmp_path / "p.svg"),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (6, 0, 72, 30)
    assert [q["output_tokens"] for q in r["requests"]] == [5] * 6  # ignore_eos: as long as asked
    assert all(q["ttft_ms"] > 0 and q["e2el_ms"] >= q["ttft_ms"] for q in r["requests"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # every request within the loose SLOs
    assert r["output_throughput"] == pytest.approx(30 / r["duration"])
    assert all(ordered(r, m) for m in ("ttft", "tpot", "itl", "e2el")) and r["mean_tpot_ms"] > 0
    assert (tmp_path / "p.svg").read_text().count("<polyline") == 4
    assert "Output token throughput (tok/s)" in run.stdout


def test_goodput_counts_only_requests_within_every_slo(mesh: Mesh, tmp_path: Path) -> None:
    run, r = bench(tmp_path, "--base-url", mesh.http_url(), "--num-prompts", "3", "--input-len", "8",
                   "--output-len", "3", "--goodput", "ttft:600000 tpot:0.000001")  # fmt: skip
    assert run.returncode == 0 and r["completed"] == 3, run.stderr
    assert r["request_goodput"] == 0.0  # no request makes a token in a nanosecond


def test_multi_turn_chat_sessions_carry_the_conversation(mesh: Mesh, tmp_path: Path) -> None:
    run, r = bench(tmp_path, "--backend", "openai-chat", "--base-url", mesh.http_url(), "--num-prompts", "2",
                   "--turns", "3", "--input-len", "6", "--output-len", "4", "--request-rate", "50")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert r["completed"] == 6 and r["failed"] == 0
    for s in (0, 1):
        prompts = [q["prompt_tokens"] for q in r["requests"] if q["session"] == s]
        assert len(prompts) == 3 and prompts[0] < prompts[1] < prompts[2]  # each turn resends the ones before


def test_an_unreachable_endpoint_is_failed_requests(tmp_path: Path) -> None:
    run, r = bench(tmp_path, "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                   "--input-len", "4", "--output-len", "2")  # fmt: skip
    assert run.returncode == 1 and (r["completed"], r["failed"]) == (0, 2)
    assert "ConnectionRefusedError" in r["errors"][0]


def test_bad_flags_are_refused_naming_them(tmp_path: Path) -> None:
    run, _ = bench(tmp_path, "--goodput", "latency:5")
    assert run.returncode == 2 and "goodput: unknown metric 'latency'" in run.stderr
    run, _ = bench(tmp_path, "--turns", "2")  # multi-turn needs a chat backend
    assert run.returncode == 2 and "chat backend" in run.stderr
