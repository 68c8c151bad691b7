"""Fixtures for the grammar tests: the grammar service as a real process on loopback, and its /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.serving.healthcheck import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class GrammarProcess:
    """``python -m services.grammar`` with its own env."""

    tmp: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> GrammarProcess:
        self.port, self.metrics_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(DEEPINFER_LOG_LEVEL="info", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
        env.update(self.env)
        log = open(self.tmp / "grammar.log", "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.grammar", "--port", str(self.port), "--metrics-port",
             str(self.metrics_port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_serving(self.address, timeout=60, proc=self.proc)
        return self

    def stop(self) -> int | None:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def children(self) -> list[int]:
        """The pids of the service's compile processes."""
        assert self.proc is not None
        text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return [int(p) for p in text.split()]

    def busy_child(self, interval_s: float = 0.3) -> int:
        """The pid of the compile process using the most CPU over ``interval_s`` (the one compiling)."""

        def cpu(pid: int) -> int:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        pids = self.children()
        before = {pid: cpu(pid) for pid in pids}
        time.sleep(interval_s)
        return max(pids, key=lambda pid: cpu(pid) - before[pid])

    def wait_idle_processes(self, n: int, timeout_s: float = 30.0) -> None:
        """Wait until ``n`` compile processes are ready and idle (replacements take seconds to start)."""
        deadline = time.monotonic() + timeout_s
        while self.metric("deepinfer_grammar_processes", state="idle") < n:
            assert time.monotonic() < deadline, f"fewer than {n} idle compile processes after {timeout_s} s"
            time.sleep(0.1)

    def log(self) -> str:
        return (self.tmp / "grammar.log").read_text()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples that carry ``labels`` (and any others, e.g. every ``backend``)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and labels.items() <= s.labels.items()
        )


@pytest.fixture(scope="module")
def grammar_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrammarProcess]:
    """One grammar service (two compile processes; the property limit raised to 3000 so that a slow grammar
    can pass the checks and meet the compile time limit; xgrammar only, whose time limit and crashes these
    tests exercise — ``auto`` would compile the slow grammar with llguidance) shared by a module's tests."""
    env = {"DEEPINFER_GRAMMAR_WORKERS": "2", "DEEPINFER_GRAMMAR_MAX_PROPERTIES": "3000",
           "DEEPINFER_GRAMMAR_BACKEND": "xgrammar"}  # fmt: skip
    service = GrammarProcess(tmp_path_factory.mktemp("grammar"), env)
    service.start()
    try:
        yield service
    finally:
        code = service.stop()
        assert code in (None, 0), service.log()
