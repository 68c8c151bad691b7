"""One way to run a gRPC server: aio, health checking, reflection, graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deepinfer.telemetry import get_logger

log = get_logger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
CHANNEL_OPTIONS = SERVER_OPTIONS


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


async def start_server(services: list[Service], host: str, port: int) -> RunningServer:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    for s in services:
        s.add(s.servicer, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    await server.start()
    running = RunningServer(server, hs, bound, names)
    await running.set_serving(True)
    log.info("listening", address=f"{host}:{bound}", services=names)
    return running


async def serve(
    services: list[Service],
    host: str,
    port: int,
    grace_s: float = 30.0,
    on_drain: Callable[[float], Awaitable[None]] | None = None,
    on_started: Callable[[RunningServer], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT: then health NOT_SERVING, ``on_drain(grace)``, stop within ``grace_s``."""
    running = await start_server(services, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_started is not None:
        await on_started(running)
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
    from deepinfer.serving.errors import ModelNotFound, Overloaded, Unavailable

    if isinstance(exc, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error"
