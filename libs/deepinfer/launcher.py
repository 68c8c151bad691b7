"""``deepinfer up``: the whole mesh on one machine — NATS, the kvstore, the grammar service, per replica a worker
and a scheduler, the balancer.

NATS is the server named by ``DEEPINFER_NATS_URL``, or a local ``nats-server`` started here (JetStream on).

Every service is its own process (``python -m services.<name>``), exactly as on many machines; this
module only picks ports, starts them in dependency order, waits for each to report SERVING through
gRPC health checking, prints the endpoints and stops everything (SIGTERM, then SIGKILL after a grace
period) on Ctrl-C, SIGTERM, or when any service dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.serving.healthcheck import free_port, wait_serving
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


@dataclass
class Mesh:
    """The processes of one local deployment."""

    model: Path
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    replicas: int = 1
    accelerator: str = "cpu"
    log_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    endpoints: dict[str, str] = field(default_factory=dict)
    nats: Any = None  # the NatsServer this mesh started (None when DEEPINFER_NATS_URL names one)

    def _spawn(self, name: str, args: list[str], ready: str | None, timeout: float = 600.0) -> None:
        env = {**os.environ, **self.extra_env, "DEEPINFER_ACCELERATOR": self.accelerator, "PYTHONUNBUFFERED": "1"}
        out = open(self.log_dir / f"{name}.log", "w") if self.log_dir else None  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], env=env, stdout=out, stderr=subprocess.STDOUT if out else None
        )
        self.procs.append((name, proc))
        if ready is not None:
            wait_serving(ready, timeout, proc)

    def start(self) -> Mesh:
        from deepinfer import envs
        from deepinfer.events import server_url_or_start

        if self.accelerator == "cpu" and not envs.is_set("DEEPINFER_TORCH_THREADS"):
            # the worker's OpenMP threads would otherwise compete with the scheduler and the balancer
            self.extra_env["DEEPINFER_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 2) - 1))
        url, self.nats = server_url_or_start()
        self.extra_env["DEEPINFER_NATS_URL"] = url
        self.endpoints["nats"] = url
        kport = free_port(self.host)
        kaddr = f"{self.host}:{kport}"
        data_dir = envs.DEEPINFER_KVSTORE_DIR or envs.DEEPINFER_CACHE_DIR / "kvstore"
        kv_args = ["services.kvstore", "--host", self.host, "--port", str(kport), "--data-dir", str(data_dir)]
        self._spawn("kvstore", kv_args, kaddr)
        self.endpoints["kvstore"] = kaddr
        self.extra_env.setdefault("DEEPINFER_KVSTORE_URL", kaddr)  # workers offload resume points there
        gport = free_port(self.host)
        gaddr = f"{self.host}:{gport}"
        grammar_args = ["services.grammar", "--model", str(self.model), "--host", self.host, "--port", str(gport)]
        self._spawn("grammar", grammar_args, gaddr)
        self.endpoints["grammar"] = gaddr
        self.extra_env.setdefault("DEEPINFER_GRAMMAR_URL", gaddr)  # the balancer compiles constraints there
        schedulers = []
        worker_service = "services.worker_ascend" if self.accelerator == "ascend" else "services.worker_nvidia"
        for r in range(self.replicas):
            wport, sport = free_port(self.host), free_port(self.host)
            waddr, saddr = f"{self.host}:{wport}", f"{self.host}:{sport}"
            self._spawn(
                f"worker-{r}",
                [worker_service, "--model", str(self.model), "--host", self.host, "--port", str(wport)],
                waddr,
            )
            self._spawn(
                f"scheduler-{r}",
                ["services.scheduler", "--worker", waddr, "--host", self.host, "--port", str(sport)],
                saddr,
            )
            schedulers += ["--scheduler", saddr]
            self.endpoints[f"scheduler-{r}"] = saddr
        args = [
            "services.balancer",
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--grpc-port",
            str(self.grpc_port),
        ]
        args += ["--http-port", str(max(self.http_port, 0))]  # 0: no HTTP
        gaddr = f"{self.host}:{self.grpc_port}"
        self._spawn("balancer", args + schedulers, gaddr)
        self.endpoints["grpc"] = gaddr
        if self.http_port > 0:
            self.endpoints["http"] = f"http://{self.host}:{self.http_port}/v1"
        return self

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def stop(self, grace_s: float = 20.0) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        if self.nats is not None:
            self.nats.close()
            self.nats = None

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
