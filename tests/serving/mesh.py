"""Start the services as real processes on loopback (worker on the cpu backend, scheduler, balancer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.serving.healthcheck import free_port, status, wait_serving
from service_env import GRAMMAR_WORKERS

ROOT = Path(__file__).resolve().parents[2]


def health_status(address: str) -> int:
    return status(address, timeout=5)


@dataclass
class Mesh:
    model: Path
    tmp: Path
    nats_url: str | None = None  # services register on this NATS server
    nats: Any = None  # or on this NatsServer, each service with its own kind's credentials (url_for)
    discover: bool = False  # the balancer finds its schedulers in the NATS registry (no --scheduler)
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. DEEPINFER_MAX_NUM_SEQS, DEEPINFER_OTEL_ENDPOINT
    balancer_args: list[str] = field(default_factory=list)  # e.g. ["--served-model-name", "x"]
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)  # one service's own env, e.g. {"worker": ..}
    worker_model: Path | None = None  # the worker's model directory, when it differs from the others' (``model``)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        env.update(DEEPINFER_ACCELERATOR="cpu", DEEPINFER_LOG_LEVEL="warning", PYTHONUNBUFFERED="1")
        env["DEEPINFER_GRAMMAR_WORKERS"] = GRAMMAR_WORKERS
        if self.nats_url:
            env["DEEPINFER_NATS_URL"] = self.nats_url
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
        env.update(self.extra_env)
        return env

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        env = self.env()
        if self.nats is not None:
            env["DEEPINFER_NATS_URL"] = self.nats.url_for(name.split("-")[0])
        env.update(self.service_env.get(name, {}))
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    def metrics_url(self, name: str) -> str:
        """The Prometheus endpoint of ``"worker"`` or ``"scheduler"``."""
        return f"http://127.0.0.1:{self.ports[name + '_metrics']}/metrics"

    def up(
        self, num_pages: int = 256, max_queued: int = 1024, http: bool = True, grace_s: float = 5.0,
        grammar: bool = False,
    ) -> Mesh:  # fmt: skip
        """Start worker, scheduler and balancer; with ``http`` the balancer also serves HTTP on ``ports["http"]``.
        The worker and the scheduler serve Prometheus metrics (``metrics_url``). With ``grammar`` the grammar
        service starts first and the balancer compiles structured-output constraints with it."""
        if grammar:
            self.ports["grammar"] = free_port()
            self.start_grammar()
            self.extra_env["DEEPINFER_GRAMMAR_URL"] = self.address("grammar")
        self._serve("worker", ("worker", "worker_metrics"), lambda: [
            "services.worker_nvidia", "--model", str(self.worker_model or self.model),
            "--port", str(self.ports["worker"]),
            "--page-size", "16", "--num-pages", str(num_pages),
            "--metrics-port", str(self.ports["worker_metrics"])])  # fmt: skip
        self._serve("scheduler", ("scheduler", "scheduler_metrics"), lambda: [
            "services.scheduler", "--worker", self.address("worker"), "--port", str(self.ports["scheduler"]),
            "--max-queued", str(max_queued), "--grace", str(grace_s),
            "--metrics-port", str(self.ports["scheduler_metrics"])])  # fmt: skip
        self._serve("balancer", ("balancer", *(["http"] if http else [])), lambda: [
            "services.balancer", "--model", str(self.model),
            *([] if self.discover else ["--scheduler", self.address("scheduler")]),
            "--grpc-port", str(self.ports["balancer"]), "--http-port", str(self.ports.get("http", 0)),
            *self.balancer_args])  # fmt: skip
        return self  # the balancer's HTTP server listens before its gRPC server reports SERVING

    def _serve(self, name: str, ports: tuple[str, ...], args: Callable[[], list[str]], attempts: int = 3) -> None:
        """Start ``name`` on fresh ``ports`` and wait until it serves. A port found free can be taken by another
        process (an outgoing connection's ephemeral port) before the service binds it; the service then exits, and
        it is started again on other ports."""
        for attempt in range(attempts):
            for n in ports:
                self.ports[n] = free_port()
            self.start(name, args())
            try:
                wait_serving(self.address(name), proc=self.procs[name])
                return
            except RuntimeError:  # it exited before serving
                if attempt == attempts - 1:
                    raise

    def start_grammar(self) -> None:
        """(Re)start the grammar service on its port."""
        self.start("grammar", ["services.grammar", "--model", str(self.model), "--port", str(self.ports["grammar"])])
        wait_serving(self.address("grammar"))

    def stop(self, name: str) -> None:
        """SIGTERM one service and wait for it."""
        p = self.procs[name]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def down(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
