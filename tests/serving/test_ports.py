"""Ports for local meshes: a picked port stays out of the kernel's ephemeral range, and a reserved one cannot be taken
by anything but the gRPC server it is meant for (the launcher's services bind seconds after the pick)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from deepinfer.rpc.channel import server_options
from deepinfer.serving.healthcheck import _ephemeral_floor, check, free_port, reserve_port


def test_free_port_is_free_and_below_the_ephemeral_range() -> None:
    floor = _ephemeral_floor()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < floor
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_reserved_port_is_refused_to_others_and_taken_by_a_grpc_server() -> None:
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        assert reserve_port_never_repeats(port)

        async def serve_then_release() -> tuple[bool, bool]:
            server = grpc.aio.server(options=server_options())
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            try:
                before = await asyncio.to_thread(check, f"127.0.0.1:{port}")
                held.close()
                after = await asyncio.to_thread(check, f"127.0.0.1:{port}")
                return before, after
            finally:
                await server.stop(0)

        assert asyncio.run(serve_then_release()) == (True, True)
    finally:
        held.close()


def reserve_port_never_repeats(port: int) -> bool:
    """Other reservations made while ``port`` is held are all different ports."""
    others = [reserve_port() for _ in range(20)]
    try:
        return all(o.getsockname()[1] != port for o in others)
    finally:
        for o in others:
            o.close()
