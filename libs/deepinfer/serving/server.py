"""One way to run a gRPC server: aio, health checking, reflection, graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import stat
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deepinfer import envs
from deepinfer.engine.heap import freeze_heap
from deepinfer.rpc.auth import ApiKeys, ServerGuard
from deepinfer.rpc.channel import internal_token, is_loopback, server_options
from deepinfer.rpc.tls import enabled as tls_enabled
from deepinfer.rpc.tls import server_credentials
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


@dataclass
class Service:
    """A servicer to mount: ``add(servicer, server)`` is the generated ``add_XServicer_to_server``."""

    name: str  # full name, e.g. "deepinfer.v1.Worker"
    servicer: Any
    add: Callable[[Any, grpc.aio.Server], None]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    names: list[str] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.names]:
            await self.health.set(name, status)


def tune_interpreter() -> None:
    """A service process's interpreter settings: the thread switch interval (``DEEPINFER_SWITCH_INTERVAL_S``)."""
    sys.setswitchinterval(envs.DEEPINFER_SWITCH_INTERVAL_S)


def _bind_unix(server: grpc.aio.Server, path: Path, creds: grpc.ServerCredentials | None) -> None:
    """Listen on the Unix socket ``path`` too (a stale socket of an earlier run is replaced; any other file is
    refused, never deleted)."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise RuntimeError(f"cannot listen on unix:{path}: a file that is not a socket is there")
        path.unlink()
    address = f"unix:{path}"
    if (server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)) == 0:
        raise RuntimeError(f"cannot listen on {address}")


def check_exposure(host: str, public: bool, internal: bool, keys: ApiKeys | None = None) -> None:
    """Refuse to serve beyond loopback without credentials (unless ``DEEPINFER_ALLOW_UNAUTHENTICATED``); mutual
    TLS (``DEEPINFER_TLS_*``) is an internal credential, as the internal token is."""
    if is_loopback(host) or envs.DEEPINFER_ALLOW_UNAUTHENTICATED:
        return
    missing = []
    if public and not (keys or ApiKeys()).enabled:
        missing.append("DEEPINFER_API_KEYS or DEEPINFER_API_KEY_FILE (the public API's keys)")
    if internal and internal_token() is None and not tls_enabled():
        missing.append(
            "DEEPINFER_INTERNAL_TOKEN or DEEPINFER_INTERNAL_TOKEN_FILE (the mesh's internal token) or "
            "DEEPINFER_TLS_CA, DEEPINFER_TLS_CERT and DEEPINFER_TLS_KEY (mutual TLS)"
        )
    if missing:
        raise RuntimeError(
            f"refusing to listen on {host} (not loopback) without credentials: set {' and '.join(missing)}, "
            "or DEEPINFER_ALLOW_UNAUTHENTICATED=1 on an isolated network"
        )


async def start_server(
    services: list[Service], host: str, port: int, public: tuple[str, ...] = (), unix_socket: Path | None = None
) -> RunningServer:
    """Start a gRPC server with ``services``; those named in ``public`` take API keys, the others the internal
    token (:class:`deepinfer.rpc.auth.ServerGuard`). With TLS configured (:mod:`deepinfer.rpc.tls`) it listens
    with TLS and, when any service is internal, requires a client certificate signed by the mesh's CA; a server
    of public services only (the balancer) asks public clients for none. ``unix_socket``: a Unix socket it
    listens on too, mode 0600 (same credentials and guard)."""
    keys = ApiKeys()
    internal = any(s.name not in public for s in services)
    check_exposure(host, bool(public), internal, keys)
    creds = server_credentials(require_client_auth=internal)
    server = grpc.aio.server(options=server_options(), interceptors=[ServerGuard(public, keys)])
    for s in services:
        s.add(s.servicer, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    if unix_socket is not None:
        _bind_unix(server, unix_socket, creds)
    await server.start()
    if unix_socket is not None:
        os.chmod(unix_socket, 0o600)  # the socket's own user only (the directory should be private too)
    running = RunningServer(server, hs, bound, names)
    await running.set_serving(True)
    log.info("listening", address=f"{host}:{bound}", unix=str(unix_socket or ""), services=names, tls=creds is not None)
    return running


async def serve(
    services: list[Service],
    host: str,
    port: int,
    grace_s: float = 30.0,
    on_drain: Callable[[float], Awaitable[None]] | None = None,
    on_started: Callable[[RunningServer], Awaitable[None]] | None = None,
    public: tuple[str, ...] = (),
    unix_socket: Path | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT: then health NOT_SERVING, ``on_drain(grace)``, stop within ``grace_s``."""
    running = await start_server(services, host, port, public, unix_socket)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_started is not None:
        await on_started(running)
    if envs.DEEPINFER_GC_FREEZE and not gc.get_freeze_count():  # (the worker froze after its warm-up already)
        log.info("heap_frozen", **freeze_heap())
    done = asyncio.ensure_future(running.server.wait_for_termination())
    await asyncio.wait([done, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    log.info("draining", grace_s=grace_s)
    await running.health.enter_graceful_shutdown()
    if on_drain is not None:
        try:
            await asyncio.wait_for(on_drain(grace_s), timeout=grace_s)
        except TimeoutError:
            log.warning("drain_timeout", grace_s=grace_s)
    await running.server.stop(grace=min(grace_s, 5.0))
    log.info("stopped")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of a domain error (never leaks a traceback)."""
    from google.protobuf.message import DecodeError

    from deepinfer.serving.errors import ModelNotFound, Overloaded, Precondition, RequestFailed, Unavailable

    if isinstance(exc, DecodeError):
        return grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid protobuf message"

    if isinstance(exc, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, RequestFailed):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, Precondition):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error"
