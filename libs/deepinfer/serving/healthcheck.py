"""gRPC health probes, and ``python -m deepinfer.serving.healthcheck HOST:PORT`` (exit 0 when SERVING).

The module form is for container health checks and startup probes (the image has no grpc_health_probe);
the functions serve ``deepinfer up`` and the tests. With ``DEEPINFER_TLS_*`` set, probes speak TLS and present
the service's certificate (internal services require one), exactly as the mesh's own channels do.
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer.rpc.tls import channel_credentials

SERVING = health_pb2.HealthCheckResponse.SERVING


_pick = random.Random()  # its own generator: a test that seeds ``random`` must not make two processes pick alike


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (and to ``bind(host, 0)``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host``, below the ephemeral range: between this pick and its server's
    bind, no outgoing connection can be given it (the kernel takes those from the ephemeral range). For a gRPC
    server's port prefer :func:`reserve_port`, which holds the port until the server listens."""
    top = _ephemeral_floor()
    bottom = max(1024, top // 2)
    for _ in range(256):
        port = _pick.randrange(bottom, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A bound, not listening socket holding a free port for a gRPC server: no other socket can bind the port and
    no outgoing connection is given it while the holder is open, yet a gRPC server (which binds with
    ``SO_REUSEPORT``) of the same user can listen on it. Close it once that server is serving."""
    s = socket.socket()
    s.bind((host, 0))  # bound before SO_REUSEPORT is set: never shares a port another server already listens on
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return s


def status(address: str, timeout: float = 3.0) -> int:
    """The server's overall health status (``grpc.RpcError`` when it cannot be reached)."""
    creds = channel_credentials()
    with grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def check(address: str, timeout: float = 3.0) -> bool:
    try:
        return status(address, timeout) == SERVING
    except grpc.RpcError:
        return False


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of the log file ``path`` (empty when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_serving(
    address: str, timeout: float = 90.0, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Block until ``address`` reports SERVING; fail early if ``proc`` (the server's process) exits, with the last
    lines of its ``log`` file (where its output goes) in the error."""
    deadline = time.monotonic() + timeout
    while not check(address, timeout=1.0):
        if proc is not None and proc.poll() is not None:
            what = f"{' '.join(map(str, proc.args[1:3]))} exited with code {proc.returncode} before serving"
            tail = log_tail(log) if log is not None else ""
            if tail:
                what += f"; the end of its log ({log}):\n" + "\n".join("  " + line for line in tail.splitlines())
            raise RuntimeError(what)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f} s")
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and check(sys.argv[1]) else 1)
