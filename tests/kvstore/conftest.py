"""Fixtures for the kvstore tests: the service as a real process on loopback, and its /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.serving.healthcheck import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


@dataclass
class KVStoreProcess:
    """``python -m services.kvstore`` with its own env; ``start()`` again after ``stop()`` restarts it."""

    tmp: Path
    data_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    port: int = 0
    metrics_port: int = 0
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> KVStoreProcess:
        """Start the process and wait until it serves. A first start whose free ports another process took in the
        meantime (it exits before serving) is retried on fresh ports, twice; the last failure carries the log."""
        fresh = not self.port  # a restart keeps the address
        attempts = 3 if fresh else 1
        for attempt in range(attempts):
            if fresh:
                self.port, self.metrics_port = free_port(), free_port()
            try:
                return self._start()
            except RuntimeError as e:
                if attempt == attempts - 1:
                    raise RuntimeError(f"{e}; its log ends:\n{self.log()[-2000:]}") from None
        return self

    def _start(self) -> KVStoreProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(DEEPINFER_LOG_LEVEL="info", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
        env.update(self.env)
        args = ["--port", str(self.port), "--metrics-port", str(self.metrics_port)]
        if self.data_dir is not None:
            args += ["--data-dir", str(self.data_dir)]
        self.starts += 1
        log = open(self.tmp / f"kvstore-{self.starts}.log", "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        wait_serving(self.address, timeout=30, proc=self.proc)
        return self

    def stop(self) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def log(self) -> str:
        return (self.tmp / f"kvstore-{self.starts}.log").read_text()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics: ``{(name, sorted labels): value}``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def kvstore_factory(tmp_path: Path) -> Iterator:
    """``kvstore_factory(data_dir=..., **env)`` starts a kvstore process; all are stopped afterwards."""
    started: list[KVStoreProcess] = []

    def make(data_dir: Path | None = None, **env: str) -> KVStoreProcess:
        kv = KVStoreProcess(tmp_path, data_dir, dict(env))
        started.append(kv)
        return kv.start()

    yield make
    for kv in started:
        kv.stop()


@pytest.fixture(scope="module")
def shared_kvstore(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVStoreProcess]:
    """One kvstore (host + disk tiers, 8 MiB blob limit) shared by the tests of a module."""
    tmp = tmp_path_factory.mktemp("kvstore")
    kv = KVStoreProcess(tmp, tmp / "data", {"DEEPINFER_KVSTORE_MAX_BLOB_BYTES": str(8 * MiB)}).start()
    try:
        yield kv
    finally:
        assert kv.stop() == 0, kv.log()
