"""What the smoke-mode tests share (test_smoke_<subject>.py: one file per subject, so that the test workers share
them out). Each script under ``bench/`` with a ``__main__`` guard runs as ``python bench/<subject>/<name>.py --tiny
--device cpu --out DIR`` with ``PYTHONPATH=libs:.`` (tests/ off the path: bench does not import from it), must exit
0 and write its figure into DIR, so that no benchmark rots. A new script without a smoke mode fails its subject's
test. A few scripts get extra flags that trim the smoke run (CI has 2 cores); a few results get checks of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from service_env import GRAMMAR_WORKERS

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(
    p
    for p in BENCH.rglob("*.py")
    if p.parent != BENCH and "results" not in p.parts and "__main__" in p.read_text()  # (bench/*.py: the tools)
)


def _name(p: Path) -> str:
    return p.relative_to(BENCH).as_posix()


# flags that trim a smoke run further (the script's --tiny alone is what a person runs on a CPU)
TRIM: dict[str, list[str]] = {
    "serving/routing.py": ["--policies", "cache", "--replicas", "1"],
    "serving/chaos.py": ["--duration-s", "6", "--kill-every-s", "2.5"],  # (still two kills, each restarted)
    "serving/disaggregation.py": ["--configs", "disaggregated"],
    # (the session stream; submit is the same loop, one mesh more; --kvstore off: the launcher's default mesh, with
    # its kvstore, starts in most serving tests)
    "serving/mesh_overhead.py": ["--concurrency", "2", "--kvstore", "off"],
    # (one repeat, smaller probes; no re-measuring while the suite's other worker keeps the cores busy: up to three
    # waits of 60 s for quiet otherwise)
    "engine/cpu_throughput.py": ["--quick", "--retries", "0"],
    "engine/prefix_cache.py": ["--turns", "2", "--user", "32", "--reply", "2", "--repeats", "1"],
    "engine/structured_outputs.py": [
        *("--batches", "1,2", "--tokens", "4", "--items", "2", "--steps", "3"),
        *("--profile", "2"),
    ],  # fmt: skip
    "kernels/pinned_plans.py": [
        "--rows",
        "1,3",
        "--gemm-rows",
        "16",
        "--small-rows",
        "16",
        "--moe-splits",
        "2",
        "--head-plans",
        "64x64x64x4x4",
    ],
    "engine/engine_decode.py": [
        "--batches",
        "1,2",
        "--context",
        "64",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--warm-steps",
        "1",
    ],
    "engine/router_balance.py": [
        "--prefill-tokens",
        "128",
        "--calibration-tokens",
        "256",
        "--rounds",
        "2",
        "--repeats",
        "1",
    ],
    "engine/speculative.py": [
        *("--errors", "0,1", "--tokens", "4", "--depths", "2,3", "--batches", "2"),
        *("--kernel-profile", "2", "--early-ab"),  # (the profiled runs, and the drafter drafting at launch, too)
    ],
    "engine/sweep.py": ["--batches", "1,4", "--prefill-tokens", "128,256", "--repeats", "2", "--budget-s", "2"],
    "engine/sweep_v41.py": ["--batches", "1,4", "--prefill-tokens", "128", "--repeats", "2", "--budget-s", "2"],
    "engine/batch_invariance.py": [
        "--compositions",
        "1",
        "--batches",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--target",
        "48",
        "--other-max",
        "12",
        "--context",
        "256",
        "--profile",
        "1",
    ],
}
TIMEOUT_S = {"serving/chaos.py": 300}
WITH_GRAMMAR = {"serving/chaos.py"}  # the launched meshes that keep their grammar service (chaos kills it too)
# GPU-only benchmarks whose --tiny --device cpu mode is still to be written: strict xfail, so that adding the smoke
# mode turns them green and this list must shrink with it (empty: every script has one)
NO_SMOKE_YET: set[str] = set()


def _chaos(out: Path, stdout: str) -> None:
    """Services killed under load: no request lost, every output token-exact."""
    result = json.loads(next(out.glob("*.json")).read_text())
    chaos = result["chaos"]
    assert result["kills"], "nothing was killed"
    assert chaos["completed"] > 0 and chaos["failed"] == 0, chaos
    assert chaos["exact"] == chaos["completed"], chaos
    assert "token-exact" in stdout


def _admission(out: Path, stdout: str) -> None:
    """A real balancer in front of a full replica: every request of the burst refused (429 + Retry-After /
    RESOURCE_EXHAUSTED) by the balancer's gate, none reaching the replica; the bare stacks measured beside it."""
    result = json.loads(next(out.glob("*.json")).read_text())
    assert result["replica_submits"] == 1  # only the request that holds the place reached the replica
    for who in ("ours", "bare"):
        for kind in ("http", "grpc"):
            r = result[who][kind]
            assert r["refused"] == r["requests"] == 200 and not r["not_refused"], (who, kind, r)
            assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] and r["server_cpu_us_per_request"] > 0
    assert "| http | deepinfer balancer |" in stdout and "bare stack (peer)" in stdout


def _schema_conformance(out: Path, stdout: str) -> None:
    """Real schemas through every engine: each schema counted once per engine, ours beside the raw-schema peers;
    the figures printed per set and in all."""
    result = json.loads(next(out.glob("*.json")).read_text())
    engines = result["engines"]
    assert engines[:2] == ["ours", "xgrammar"], engines
    total = result["summary"]["all"]
    for engine in engines:
        s = total[engine]
        assert s["n"] == len(result["schemas"]) >= 8, s  # one schema of each of the eight sets
        assert s["compiled"] + s["refused_named"] + s["refused_other"] + s["timeout"] + s["crash"] == s["n"], s
        assert s["valid"] + s["violations"] + s["unjudged"] == s["finished"], s
    assert "silent violations" in stdout and "| **all** |" in stdout


def _mesh_overhead(out: Path, stdout: str) -> None:
    """Both paths at every level, over the balancer's session stream to its replica; the mesh's services report each
    step's phases (launch and finish on the worker, plan and deliver on the scheduler, once per step) and their CPU."""
    result = json.loads(next(out.glob("*.json")).read_text())
    assert [(r["c"], r["streams"], r["kvstore"]) for r in result["rows"]] == [(2, "session", "off")]
    assert list(result["mesh_over_inprocess"]) == ["2"]
    assert result["mesh_no_kvstore_over_inprocess"] == result["mesh_over_inprocess"]  # (the one mesh has none)
    for r in result["rows"]:
        assert r["offline"]["output_throughput"] > 0 and r["offline"]["cpu"]["bench"] > 0
        for proto in ("grpc", "http"):
            m = r[proto]
            assert m["completed"] == r["c"] and m["failed"] == 0, m
            ph = m["phases"]
            for key in ("worker-0 launch", "worker-0 finish", "scheduler-0 plan", "scheduler-0 deliver"):
                assert ph[key]["n"] >= 4 and ph[key]["mean_ms"] > 0, (key, ph)
            # (a step launched after the requests ended, releasing them, may be collected after the last scrape; one
            # launched before the first scrape may be collected after it)
            assert -1 <= ph["worker-0 launch"]["n"] - ph["worker-0 finish"]["n"] <= 3, ph
            assert m["cpu"]["worker-0"] > 0 and "kvstore" not in m["cpu"], m["cpu"]  # (no kvstore started)
    assert "Step phases over each timed run" in stdout


def _fanout(out: Path, stdout: str) -> None:
    """Both paths deliver every step to every request (a step that never arrived would fail the run)."""
    result = json.loads(next(out.glob("*-fanout.json")).read_text())
    assert [r["n"] for r in result["rows"]] == [1, 8]
    for r in result["rows"]:
        assert r["roofline_ms"] > 0
        for path in ("submit", "session"):
            assert r[path]["server_cpu_ms_per_step"] > 0 and r[path]["lag_p50_ms"] >= 0, r
    assert "| 8 |" in stdout


def _batch_invariance(out: Path, stdout: str) -> None:
    """Both modes checked and timed; the profiled step's per-kernel account of both modes side by side."""
    result = json.loads(next(out.glob("*.json")).read_text())
    assert result["check"]["invariant"]["bit_identical"] == result["check"]["invariant"]["compositions"] == 1
    for mode in ("default", "invariant"):
        assert result["profiles"][mode]["1"]["kernels_us"], mode  # (JSON keys: the batch size as text)
    assert "Batch 1, one step profiled" in stdout and "| kernel | default µs | invariant µs | Δ µs |" in stdout


def _prefix_turns(out: Path, stdout: str) -> None:
    """Each turn after the first resumes from the previous turn's sequence end (all of it cached but its last token,
    whose state the reply's last step did not compute); the salted peer never finds anything (the script checks)."""
    turns = json.loads(next(out.glob("*.json")).read_text())["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["cached_tokens"] == 0
    for before, t in zip(turns, turns[1:]):
        assert t["cached_tokens"] == before["prompt_tokens"] + 4 - 1, (before, t)  # (--tiny: 4-token replies)
        assert t["ttft_ms"] > 0 and t["ttft_no_cache_ms"] > 0 and t["roofline_new_tokens_ms"] > 0
    assert "TTFT(turn 3) / TTFT(turn 1)" in stdout


def _sampling(out: Path, stdout: str) -> None:
    """The top-logprobs section: ours beside the full sort at each batch size (the script asserts the same ids)."""
    result = json.loads(next(out.glob("*.json")).read_text())
    top = result["top_logprobs"]
    assert [r["batch"] for r in top] == [1, 2] and all(r["ours_ms"] > 0 and r["sort_ms"] > 0 for r in top), top
    assert "full sort ms (peer)" in stdout


def _structured_outputs(out: Path, stdout: str) -> None:
    """The served rows: the async engine plain, with the schema and with the schema held (the peer), per batch."""
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2], rows
    for r in rows:
        assert min(r["served_ms"], r["served_schema_ms"], r["served_schema_held_ms"], r["roofline_ms"]) > 0, r
        assert r["served_schema_compiles"] == 0
        assert abs(r["served_overhead"] - (r["served_schema_ms"] / r["served_ms"] - 1)) < 1e-9, r
        assert r["mask_fill_ms"] > 0 and r["accept_ms"] > 0, r
    assert "host_profile" not in rows[0]  # (--profile 2: the served steps at batch 2 profiled, plain and schema)
    assert all("function calls" in rows[1]["host_profile"][mode] for mode in ("plain", "schema"))  # (cProfile's)


def _pinned_plans(out: Path, stdout: str) -> None:
    """Every family timed at both row counts, the peer and each candidate; each candidate invariant in the
    interpreter (row 0 of the widest call equal to the one-row call); a pick per family."""
    result = json.loads(next(out.glob("*.json")).read_text())
    assert set(result["picks"]) == {"fp8", "small", "moe", "head"} and all(p["pick"] for p in result["picks"].values())
    for r in result["rows"]:
        assert r["us"] > 0 and r["roofline_us"] > 0 and r["rows"] in (1, 3), r
        assert r["invariant"] or r["candidate"] == "default", r
    assert {r["candidate"] for r in result["rows"] if r["family"] == "head"} == {"default", "shipped", "64x64x64x4x4"}
    assert "| default (peer) |" in stdout


CHECKS: dict[str, Callable[[Path, str], None]] = {
    "engine/structured_outputs.py": _structured_outputs,
    "kernels/pinned_plans.py": _pinned_plans,
    "kernels/sampling.py": _sampling,
    "engine/batch_invariance.py": _batch_invariance,
    "serving/prefix_turns.py": _prefix_turns,
    "serving/fanout.py": _fanout,
    "serving/mesh_overhead.py": _mesh_overhead,
    "serving/chaos.py": _chaos,
    "serving/admission.py": _admission,
    "serving/schema_conformance.py": _schema_conformance,
}


def scripts(subject: str) -> list:
    """The parameters of one subject's smoke tests (strict xfail for a script without a smoke mode yet)."""
    return [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="no CPU smoke mode yet"))
        if _name(p) in NO_SMOKE_YET
        else p
        for p in SCRIPTS
        if p.relative_to(BENCH).parts[0] == subject
    ]


def name(p: Path) -> str:
    return _name(p)


def run_smoke(script: Path, tmp_path: Path, extra: tuple[str, ...] = (), trim: bool = True) -> None:
    """``extra``: flags of another mode of the script (after its TRIM flags; without them when not ``trim``)."""
    name = _name(script)
    if name in NO_SMOKE_YET:  # fail fast: the script has no --tiny (or runs only on a GPU)
        pytest.fail(f"{name}: no CPU smoke mode")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "TRITON_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["DEEPINFER_GRAMMAR_WORKERS"] = GRAMMAR_WORKERS  # (the meshes the serving benches start)
    if name not in WITH_GRAMMAR:  # (their launched meshes send no structured output: no grammar service)
        env["DEEPINFER_UP_GRAMMAR"] = "0"
    out = tmp_path / "out"
    flags = [*(TRIM.get(name, []) if trim else []), *extra]
    cmd = [sys.executable, str(script), "--tiny", "--device", "cpu", "--out", str(out), *flags]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S.get(name, 240))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    written = [p for p in out.rglob("*") if p.is_file() and p.stat().st_size > 0] if out.exists() else []
    assert written, f"{name} wrote no result into --out\n{run.stdout[-2000:]}"
    assert run.stdout.strip(), f"{name} printed nothing"
    if name in CHECKS:
        CHECKS[name](out, run.stdout)
