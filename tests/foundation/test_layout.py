"""The repository contract: layout, the README's two commands, the CLI, the example and docker-compose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from service_env import GRAMMAR_WORKERS

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["DEEPINFER_CACHE_DIR"] = str(tmp_path / "cache")
    env["DEEPINFER_ACCELERATOR"] = "cpu"
    env["DEEPINFER_GRAMMAR_WORKERS"] = GRAMMAR_WORKERS
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    return env


def test_layout() -> None:
    for d in ["proto", "kernels", "tests", "bench", "examples", "libs/deepinfer", "docs"]:
        assert (ROOT / d).is_dir(), d
    for s in ["scheduler", "worker_nvidia", "worker_ascend", "kvstore", "balancer", "grammar"]:
        assert (ROOT / "services" / s / "__init__.py").exists(), s
    assert (ROOT / "docs" / "architecture.md").exists()


def test_the_wheel_lists_every_package() -> None:
    """pyproject.toml names the wheel's packages one by one (``deepinfer.kernels`` comes from the top-level ``kernels/``
    through ``package-dir``, which package discovery cannot express): every package folder of ``libs/deepinfer``,
    ``kernels`` and ``services`` is listed, and each listed package's folder exists."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs, listed = setup["package-dir"], set(setup["packages"])
    tops = {
        "deepinfer": ROOT / "libs" / "deepinfer",
        "deepinfer.kernels": ROOT / "kernels",
        "services": ROOT / "services",
    }
    found = {
        ".".join([name, *i.parent.relative_to(top).parts])
        for name, top in tops.items()
        for i in top.rglob("__init__.py")
    }
    assert found == listed, f"not listed: {sorted(found - listed)}; no such package: {sorted(listed - found)}"

    def folder(package: str) -> Path:  # setuptools' rule: the longest mapped prefix
        prefix = max((k for k in dirs if not k or package == k or package.startswith(k + ".")), key=len)
        return ROOT / dirs[prefix] / package[len(prefix) :].lstrip(".").replace(".", "/")

    assert all((folder(p) / "__init__.py").is_file() for p in listed)
    assert folder("deepinfer.kernels.x") == ROOT / "kernels" / "x"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme
    assert "ruff check" in ci and "ruff format --check" in ci and "pytest" in ci
    assert "deepinfer up" in readme


def test_cli_make_tiny_model_and_up(tmp_path: Path) -> None:
    env = _env(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer", "make-tiny-model", str(tmp_path / "m"), "--seed", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "model.safetensors").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    off = subprocess.run(
        [sys.executable, "-m", "deepinfer", "offline", "--max-tokens", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert off.returncode == 0, off.stderr
    assert "generating a tiny model" in off.stdout
    assert off.stdout.count("--- req-") == 3
    finished = [json.loads(line) for line in off.stderr.splitlines() if '"request_finished"' in line]
    assert sorted(f["request_id"] for f in finished) == ["req-0", "req-1", "req-2"]


def test_cli_up_runs_the_mesh(tmp_path: Path) -> None:
    from serving.mesh import free_port

    # (--no-kvstore: the mesh without its kvstore serves as well; the other launched meshes have theirs)
    args = ["up", "--demo", "--max-tokens", "4", "--grpc-port", str(free_port()), "--http-port", "0", "--no-kvstore"]
    up = subprocess.run(
        [sys.executable, "-m", "deepinfer", *args], env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.count("--- ") == 3 and "through the mesh" in up.stdout and "stopped" in up.stdout
    assert "  grammar " in up.stdout and "  kvstore " not in up.stdout  # (the endpoints it lists)
    split = ["up", "--prefill-replicas", "1", "--decode-replicas", "1", "--no-kvstore"]
    bad = subprocess.run([sys.executable, "-m", "deepinfer", *split], env=_env(tmp_path), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "hand requests off through a kvstore" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "deepinfer", "up", "--ep", "3", "--tp", "2"], env=_env(tmp_path),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "tp must divide ep" in bad.stderr


def test_a_mesh_without_a_kvstore_refuses_disaggregated_replicas(tmp_path: Path) -> None:
    """They hand requests off through it: refused before anything starts, unless another kvstore is named."""
    import pytest

    from deepinfer.launcher import Mesh

    mesh = Mesh(tmp_path, replicas=2, roles=["prefill", "decode"], kvstore=False)
    with pytest.raises(ValueError, match="hand requests off through a kvstore"):
        mesh.start()
    assert not mesh.procs and mesh.nats is None


def test_cli_reports_bad_env(tmp_path: Path) -> None:
    env = _env(tmp_path) | {"DEEPINFER_BATCH_INVARIANT": "maybe"}
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer", "offline"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "DEEPINFER_BATCH_INVARIANT" in out.stderr


def test_offline_example_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py")],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "seeded:" in out.stdout


def _constrained(address: str) -> tuple[str, str]:
    """The status of a regex-constrained request to the balancer at ``address``: (code name, details)."""
    import asyncio

    import grpc

    from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    so = common_pb2.StructuredOutput(schema_type=common_pb2.StructuredOutput.SCHEMA_TYPE_REGEX, schema="[ab]+")
    req = generation_pb2.GenerateRequest(
        text="Hi", sampling=common_pb2.SamplingParams(max_tokens=2, structured_output=so)
    )

    async def call() -> tuple[str, str]:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                _ = [m async for m in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=60)]
            except grpc.aio.AioRpcError as e:
                return e.code().name, e.details() or ""
        return "OK", ""

    return asyncio.run(call())


def test_up_serves_two_replicas_until_interrupted_and_generate_talks_to_it(tmp_path: Path) -> None:
    """(--no-grammar: the mesh starts no grammar service, and a structured-output request is refused naming it)"""
    import signal
    import time

    from serving.mesh import free_port

    env, port = _env(tmp_path), free_port()
    args = ["up", "--replicas", "2", "--grpc-port", str(port), "--http-port", "0", "--no-grammar"]
    up = subprocess.Popen(
        [sys.executable, "-m", "deepinfer", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("serving; Ctrl-C" in line for line in lines):
            line = up.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        assert any("scheduler-0" in line for line in lines) and any("scheduler-1" in line for line in lines)
        gen = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepinfer",
                "generate",
                "Hello there",
                "--grpc-port",
                str(port),
                "--max-tokens",
                "5",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        assert "FINISH_REASON_LENGTH; 2 prompt + 5 generated tokens" in gen.stdout
        assert not any(line.strip().startswith("grammar ") for line in lines), "".join(lines)  # (no such endpoint)
        code, details = _constrained(f"127.0.0.1:{port}")
        assert code == "INVALID_ARGUMENT" and "not served here" in details, (code, details)  # (not to be retried)
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, "".join(lines) + out
    assert "stopped" in out
