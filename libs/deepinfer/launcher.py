"""``deepinfer up``: the whole mesh on one machine — NATS, the kvstore, the grammar service, per replica a worker
and a scheduler, the balancer.

NATS is the server named by ``DEEPINFER_NATS_URL``, or a local ``nats-server`` started here (JetStream on, with
generated credentials: each service gets its own kind's user in its ``DEEPINFER_NATS_URL``, see ``events/auth.py``).

Every service is its own process (``python -m services.<name>``), exactly as on many machines; this
module only picks ports (and, per replica, a Unix socket in a private directory through which the scheduler
reaches its worker), starts them in dependency order (the kvstore, the grammar service and the workers side by
side, then the schedulers, then the balancer), waits for each to report SERVING through gRPC health checking and
prints the endpoints (every service's metrics too). While it runs, a service that
exits is started again with backoff (same command and ports: its peers reconnect to it); on Ctrl-C or SIGTERM
the mesh drains in order (balancer, schedulers, workers, then the rest). Internal calls carry a generated
internal token unless ``DEEPINFER_INTERNAL_TOKEN`` names one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.serving.healthcheck import free_port, reserve_port, wait_serving
from deepinfer.telemetry import get_logger

log = get_logger(__name__)
# the variable that limits the devices a process of an accelerator sees (each worker replica its own)
VISIBLE_DEVICES = {"nvidia": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}


@dataclass
class Mesh:
    """The processes of one local deployment."""

    model: Path
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # the balancer's (0: a free port, reserved until it serves)
    http_port: int = 8000
    replicas: int = 1
    roles: list[str] = field(default_factory=list)  # each replica's (mixed, prefill, decode); empty: all mixed
    ranks: int = 1  # of each replica's worker (``--ep``): one process and one device each
    tp: int = 1  # ranks of each tensor-parallel group of a replica's worker (``--tp``)
    cp: int = 1  # ranks of each context-parallel group of a replica's worker (``--cp``)
    accelerator: str = "cpu"
    log_dir: Path | None = None
    served_model_name: str | None = None  # the balancer's name for the model (default: the directory's base name)
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    specs: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)  # name -> (args, env)
    restarts: dict[str, list[float]] = field(default_factory=dict)  # name -> when it was restarted
    supervise: bool = True  # restart a service that exits (with backoff) until stop()
    unix_sockets: bool = True  # each scheduler reaches its worker through a Unix socket (not with TLS)
    kvstore: bool = True  # start the kvstore the replicas move evicted resume points to (False: only one named by
    # DEEPINFER_KVSTORE_URL, else none: evicted resume points are dropped)
    grammar: bool | None = None  # start the grammar service (None: DEEPINFER_UP_GRAMMAR; False: only one named by
    # DEEPINFER_GRAMMAR_URL, else none: structured outputs are refused, tool calls under "auto" go unconstrained)
    _sockets: Path | None = field(default=None, init=False, repr=False)  # their private directory
    _taken: set[int] = field(default_factory=set, init=False, repr=False)  # ports handed out
    _held: dict[int, Any] = field(default_factory=dict, init=False, repr=False)  # port -> its reserving socket
    _starting: dict[str, tuple[str, Any, float]] = field(default_factory=dict, init=False, repr=False)  # not yet ready
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _supervisor: threading.Thread | None = field(default=None, init=False, repr=False)
    endpoints: dict[str, str] = field(default_factory=dict)
    nats: Any = None  # the NatsServer this mesh started (None when DEEPINFER_NATS_URL names one)

    def worker_args(self, replica: int, port: int, sockets: Path | None) -> tuple[list[str], str]:
        """A replica's worker command (after ``python -m``), and the address its scheduler dials: a Unix socket in
        ``sockets`` when given, else TCP."""
        service = "services.worker_ascend" if self.accelerator == "ascend" else "services.worker_nvidia"
        args = [service, "--model", str(self.model), "--host", self.host, "--port", str(port), "--ep", str(self.ranks),
                "--tp", str(self.tp), "--cp", str(self.cp)]  # fmt: skip
        if sockets is None:
            return args, f"{self.host}:{port}"
        return [
            *args,
            "--unix-socket",
            str(sockets / f"worker-{replica}.sock"),
        ], f"unix:{sockets / f'worker-{replica}.sock'}"

    def _devices(self, replica: int) -> dict[str, str]:
        """The devices of a replica's worker, through the accelerator's visibility variable (its ranks take devices
        ``0 .. ranks-1`` of those it sees): replica ``r`` the host's devices ``r·ranks ..`` of those listed there
        already (else of all), round robin where the host has fewer (replicas then share devices, as ranks of one
        worker on fewer devices do: ``Platform.use_device``). Nothing on the cpu backend."""
        var = VISIBLE_DEVICES.get(self.accelerator)
        if var is None:
            return {}
        if os.environ.get(var):
            ids = os.environ[var].split(",")
        else:
            from deepinfer.runtime.platform import platform_for

            ids = [str(i) for i in range(max(1, platform_for(self.accelerator).device_count()))]
        first = replica * self.ranks
        return {var: ",".join(ids[(first + i) % len(ids)] for i in range(min(self.ranks, len(ids))))}

    def _spawn(self, name: str, args: list[str], ready: str | None, env_: dict[str, str] | None = None,
               timeout: float = 600.0, wait: bool = True) -> None:  # fmt: skip
        """Start ``name``; with ``ready`` (its gRPC address) wait until it serves, or with ``wait=False`` leave that
        to :meth:`_await` (services that do not need each other start side by side)."""
        env = {**os.environ, **self.extra_env, "DEEPINFER_ACCELERATOR": self.accelerator, "PYTHONUNBUFFERED": "1"}
        env.update(env_ or {})
        if self.nats is not None:  # the NATS server started here: each service its own kind's credentials
            from deepinfer.events.subjects import KINDS

            kind = name.split("-")[0]
            if kind in KINDS:
                env["DEEPINFER_NATS_URL"] = self.nats.url_for(kind)
        if args[0] != "services.balancer":  # every service's metrics on a port of its own (the balancer's: HTTP)
            mport = self._port()
            args = [*args, "--metrics-port", str(mport)]
            self.endpoints[f"{name} metrics"] = f"http://{self.host}:{mport}/metrics"
        self.specs[name] = (args, env)
        proc = self._popen(name, "w")
        self.procs.append((name, proc))
        if ready is not None:
            self._starting[name] = (ready, proc, timeout)
            if wait:
                self._await(name)

    def _await(self, *names: str) -> None:
        """Wait until the services ``names`` (default: every one started without waiting) serve; one that exits
        first raises with its log's last lines."""
        for name in names or list(self._starting):
            ready, proc, timeout = self._starting.pop(name)
            try:
                wait_serving(ready, timeout, proc, self.log_dir / f"{name}.log" if self.log_dir else None)
            finally:  # serving (or gone): the port needs holding no longer
                held = self._held.pop(int(ready.rpartition(":")[2]), None)
                if held is not None:
                    held.close()

    def _socket_dir(self) -> Path | None:
        """A private directory (mode 0700, removed by :meth:`stop`) for the worker's Unix sockets, or None: TLS is
        configured (its certificates name TCP hosts) or ``unix_sockets`` is off."""
        from deepinfer.rpc.tls import enabled as tls_enabled

        if not self.unix_sockets or tls_enabled():
            return None
        if self._sockets is None:
            self._sockets = Path(tempfile.mkdtemp(prefix="deepinfer-mesh-"))  # mkdtemp makes it 0700
        return self._sockets

    def _port(self) -> int:
        """A free port this mesh has not handed out yet (a port found free stays free until its service binds it,
        so the public ports and every earlier pick are excluded)."""
        self._taken |= {self.grpc_port, self.http_port}
        while (port := free_port(self.host)) in self._taken:
            pass
        self._taken.add(port)
        return port

    def _grpc_port(self) -> int:
        """A port for a service's gRPC server, held (:func:`reserve_port`) until that service serves: between the
        pick and the bind, often seconds of model loading, nothing else on the machine can take it."""
        held = reserve_port(self.host)
        port = held.getsockname()[1]
        self._held[port] = held
        self._taken.add(port)
        return port

    def _popen(self, name: str, mode: str) -> subprocess.Popen:
        args, env = self.specs[name]
        out = open(self.log_dir / f"{name}.log", mode) if self.log_dir else None  # noqa: SIM115
        return subprocess.Popen(
            [sys.executable, "-m", *args], env=env, stdout=out, stderr=subprocess.STDOUT if out else None
        )

    def start(self) -> Mesh:
        from deepinfer import envs
        from deepinfer.events import server_url_or_start
        from deepinfer.events.auth import redact

        named = self.extra_env.get("DEEPINFER_KVSTORE_URL") or envs.DEEPINFER_KVSTORE_URL  # (an external one)
        if not self.kvstore and set(self.roles) - {"mixed"} and not named:
            raise ValueError("prefill and decode replicas hand requests off through a kvstore: none started or named")
        if self.accelerator == "cpu" and not envs.is_set("DEEPINFER_TORCH_THREADS"):
            # the worker's OpenMP threads would otherwise compete with the scheduler and the balancer
            self.extra_env["DEEPINFER_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 2) - 1))
        if envs.DEEPINFER_INTERNAL_TOKEN is None and envs.DEEPINFER_INTERNAL_TOKEN_FILE is None:
            self.extra_env["DEEPINFER_INTERNAL_TOKEN"] = secrets.token_urlsafe(32)  # internal calls carry it
        url, self.nats = server_url_or_start()
        if self.nats is None:  # an external server: every service gets DEEPINFER_NATS_URL as it is
            self.extra_env["DEEPINFER_NATS_URL"] = url
        self.endpoints["nats"] = redact(url) if self.nats is None else self.nats.address  # printed: no password
        # the kvstore, the grammar service and the workers need none of each other: they start side by side (the
        # workers load their models while the grammar service builds its tokenizer view); the schedulers dial
        # their workers, the balancer its schedulers
        if self.kvstore:
            self._start_kvstore()
        if envs.DEEPINFER_UP_GRAMMAR if self.grammar is None else self.grammar:
            self._start_grammar()
        schedulers, dials = [], []
        sockets = self._socket_dir()
        for r in range(self.replicas):
            wport = self._grpc_port()
            worker_args, dial = self.worker_args(r, wport, sockets)
            self._spawn(f"worker-{r}", worker_args, f"{self.host}:{wport}", self._devices(r), wait=False)
            dials.append(dial)
        self._await()
        for r, dial in enumerate(dials):
            sport = self._grpc_port()
            saddr = f"{self.host}:{sport}"
            role = self.roles[r] if r < len(self.roles) else "mixed"
            self._spawn(
                f"scheduler-{r}",
                ["services.scheduler", "--worker", dial, "--host", self.host, "--port", str(sport), "--role", role],
                saddr,
                wait=False,
            )
            schedulers += ["--scheduler", saddr]
            self.endpoints[f"scheduler-{r}"] = saddr
        self._await()
        if self.grpc_port == 0:
            self.grpc_port = self._grpc_port()
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
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        gaddr = f"{self.host}:{self.grpc_port}"
        self._spawn("balancer", args + schedulers, gaddr)
        self.endpoints["grpc"] = gaddr
        if self.http_port > 0:
            self.endpoints["http"] = f"http://{self.host}:{self.http_port}/v1"
        return self

    def _start_grammar(self) -> None:
        gport = self._grpc_port()
        gaddr = f"{self.host}:{gport}"
        grammar_args = ["services.grammar", "--model", str(self.model), "--host", self.host, "--port", str(gport)]
        self._spawn("grammar", grammar_args, gaddr, wait=False)
        self.endpoints["grammar"] = gaddr
        self.extra_env.setdefault("DEEPINFER_GRAMMAR_URL", gaddr)  # the balancer compiles constraints there

    def _start_kvstore(self) -> None:
        from deepinfer import envs

        kport = self._grpc_port()
        kaddr = f"{self.host}:{kport}"
        data_dir = envs.DEEPINFER_KVSTORE_DIR or envs.DEEPINFER_CACHE_DIR / "kvstore"
        kv_args = ["services.kvstore", "--host", self.host, "--port", str(kport), "--data-dir", str(data_dir)]
        self._spawn("kvstore", kv_args, kaddr, wait=False)
        self.endpoints["kvstore"] = kaddr
        self.extra_env.setdefault("DEEPINFER_KVSTORE_URL", kaddr)  # workers offload resume points there

    def add_balancer(self, name: str, env: dict[str, str] | None = None) -> tuple[str, str]:
        """Another balancer in front of the started mesh's replicas, as ``name`` with ``env`` (e.g. another routing
        policy), supervised like the rest: its gRPC address and its OpenAI base URL."""
        args = list(self.specs["balancer"][0])
        gport, hport = self._grpc_port(), self._port()
        args[args.index("--grpc-port") + 1], args[args.index("--http-port") + 1] = str(gport), str(hport)
        self._spawn(name, args, f"{self.host}:{gport}", env)
        return f"{self.host}:{gport}", f"http://{self.host}:{hport}/v1"

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    # -- supervision -------------------------------------------------------------------------------------------
    def start_supervisor(self) -> None:
        """Watch the services from a thread: one that exits is started again (same command, ports and log) after
        a backoff of 0.5 s doubling per crash within a minute, up to ``DEEPINFER_RESTART_MAX_BACKOFF_S``."""
        self._supervisor = threading.Thread(target=self._supervise, name="mesh-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self, poll_s: float = 0.1) -> None:
        due: dict[str, float] = {}
        while not self._stopping.wait(poll_s):
            now = time.monotonic()
            for i, (name, p) in enumerate(list(self.procs)):
                if p.poll() is None or self._stopping.is_set():
                    continue
                if name not in due:
                    due[name] = now + self.backoff_s(name, now)
                    log.warning("service_exited", service=name, code=p.returncode, restart_in_s=due[name] - now)
                elif now >= due[name]:
                    del due[name]
                    self.restarts.setdefault(name, []).append(now)
                    self.procs[i] = (name, self._popen(name, "a"))
                    log.warning("service_restarted", service=name, restarts=len(self.restarts[name]))
            if self.nats is not None and not self.nats.running and not self._stopping.is_set():
                log.warning("nats_restarting")
                self.nats.start()  # same port and store: the services reconnect by themselves

    def backoff_s(self, name: str, now: float, window_s: float = 60.0) -> float:
        from deepinfer import envs

        recent = [t for t in self.restarts.get(name, []) if now - t < window_s]
        return min(0.5 * 2 ** len(recent), envs.DEEPINFER_RESTART_MAX_BACKOFF_S)

    # -- stopping -------------------------------------------------------------------------------------------------
    TIERS = ("balancer", "scheduler", "worker", "grammar", "kvstore")  # the order a drain stops them in

    def stop(self, grace_s: float | None = None) -> None:
        """Drain in order: the balancer (stops admitting, finishes its streams), then the schedulers (deregistered,
        finishing what they run), then the workers, then grammar and kvstore, then NATS; each tier gets SIGTERM and
        ``grace_s`` (default ``DEEPINFER_DRAIN_GRACE_S``) plus a margin before SIGKILL."""
        from deepinfer import envs

        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        grace = envs.DEEPINFER_DRAIN_GRACE_S if grace_s is None else grace_s
        for tier in self.TIERS:
            group = [p for name, p in self.procs if name.split("-")[0] == tier]
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace + 5.0
            for p in group:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        self._starting.clear()
        for held in self._held.values():  # a start that failed part-way
            held.close()
        self._held.clear()
        if self.nats is not None:
            self.nats.close()
            self.nats = None
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None

    def __enter__(self) -> Mesh:
        self.start()
        if self.supervise:
            self.start_supervisor()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
