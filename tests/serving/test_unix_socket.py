"""A worker's Unix socket (``start_server(unix_socket=)``, ``--unix-socket``): the scheduler on the same host reaches
its worker through it. Real gRPC servers and channels: the socket is its user's only (mode 0600), calls on it still
need the internal token, a stale socket of a killed run is replaced, and any other file in its place is refused and
left alone."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer.rpc.channel import INTERNAL_HEADER
from deepinfer.serving.server import Service, start_server, tune_interpreter
from deepinfer.v1 import worker_pb2, worker_pb2_grpc

TOKEN = "unix-socket-test-token"


def _worker_service() -> Service:
    """The Worker service with no model behind it: every RPC UNIMPLEMENTED once past the guard."""
    return Service(
        "deepinfer.v1.Worker", worker_pb2_grpc.WorkerServicer(), worker_pb2_grpc.add_WorkerServicer_to_server
    )


async def _info(address: str, token: str | None) -> grpc.StatusCode:
    md = [(INTERNAL_HEADER, token)] if token else []
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(
                worker_pb2.GetWorkerInfoRequest(), metadata=md, timeout=10
            )
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def _serve_and_call(path: Path) -> tuple[int, list[grpc.StatusCode], int, int]:
    running = await start_server([_worker_service()], "127.0.0.1", 0, unix_socket=path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        codes = [await _info(f"unix:{path}", None), await _info(f"unix:{path}", TOKEN)]
        async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        tcp = await _info(f"127.0.0.1:{running.port}", TOKEN)  # the TCP port serves as before
        return mode, codes, health.status, tcp
    finally:
        await running.server.stop(None)


def test_the_socket_is_private_guarded_and_serves_beside_tcp(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_INTERNAL_TOKEN", TOKEN)
    mode, codes, health, tcp = asyncio.run(_serve_and_call(tmp_path / "w.sock"))
    assert mode == 0o600
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED]  # the guard, then the servicer
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert tcp == grpc.StatusCode.UNIMPLEMENTED


def test_a_stale_socket_is_replaced(tmp_path, monkeypatch) -> None:
    """A worker killed with SIGKILL leaves its socket file (a graceful stop removes it); the restarted worker binds
    the same path."""
    monkeypatch.setenv("DEEPINFER_INTERNAL_TOKEN", TOKEN)
    path = tmp_path / "w.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # what a killed process leaves: the file, no listener
    dead.close()
    assert stat.S_ISSOCK(path.lstat().st_mode)
    mode, codes, _, _ = asyncio.run(_serve_and_call(path))
    assert mode == 0o600 and codes[1] == grpc.StatusCode.UNIMPLEMENTED


def test_another_file_in_the_sockets_place_is_refused_and_kept(tmp_path) -> None:
    path = tmp_path / "w.sock"
    path.write_text("not a socket")
    with pytest.raises(RuntimeError, match="not a socket"):
        asyncio.run(start_server([_worker_service()], "127.0.0.1", 0, unix_socket=path))
    assert path.read_text() == "not a socket"


def test_the_switch_interval_is_the_setting(monkeypatch) -> None:
    before = sys.getswitchinterval()
    try:
        monkeypatch.setenv("DEEPINFER_SWITCH_INTERVAL_S", "0.002")
        tune_interpreter()
        assert abs(sys.getswitchinterval() - 0.002) < 1e-9
        monkeypatch.setenv("DEEPINFER_SWITCH_INTERVAL_S", "7")  # past the setting's maximum: refused by name
        with pytest.raises(ValueError, match="DEEPINFER_SWITCH_INTERVAL_S"):
            tune_interpreter()
    finally:
        sys.setswitchinterval(before)
        os.environ.pop("DEEPINFER_SWITCH_INTERVAL_S", None)
