"""gRPC health probes, and ``python -m deepinfer.serving.healthcheck HOST:PORT`` (exit 0 when SERVING).

The module form is for container health checks and startup probes (the image has no grpc_health_probe);
the functions serve ``deepinfer up`` and the tests. With ``DEEPINFER_TLS_*`` set, probes speak TLS and present
the service's certificate (internal services require one), exactly as the mesh's own channels do.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer.rpc.tls import channel_credentials

SERVING = health_pb2.HealthCheckResponse.SERVING


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host`` (for local deployments and tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
