"""How the mesh's gRPC ends talk: one set of keepalive and size options for every server and channel, the
internal credential every internal call carries, TLS when configured (:mod:`deepinfer.rpc.tls`), and
reconnection backoff.

Keepalive must agree on both ends: a client pinging more often than its server permits gets GOAWAY
``too_many_pings`` and loses its connection (and with it every stream on it). So every channel pings every
``DEEPINFER_GRPC_KEEPALIVE_S`` (calls or not) and every server permits pings from half that interval on.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import grpc

from deepinfer import envs
from deepinfer.rpc.tls import channel_credentials

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
INTERNAL_HEADER = "x-deepinfer-internal"  # metadata key of the internal token
INITIAL_BACKOFF_S = 0.1
PENDING_CALLS = 20_000  # calls a server holds before the application picks them up (gRPC core: 1000)


def _keepalive_ms() -> tuple[int, int]:
    return int(envs.DEEPINFER_GRPC_KEEPALIVE_S * 1000), int(envs.DEEPINFER_GRPC_KEEPALIVE_TIMEOUT_S * 1000)


def server_options() -> list[tuple[str, Any]]:
    """Options of every gRPC server: it pings idle clients too, and never refuses their pings."""
    every, timeout = _keepalive_ms()
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", every),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # the server's side of the agreement: pings from clients every `every` ms (and some jitter) are fine
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1, every // 2)),
        ("grpc.http2.min_ping_interval_without_data_ms", max(1, every // 2)),
        ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for its pings
        # gRPC core sheds calls that arrived but were not yet picked up by the application once more than 1000
        # wait (at random, as CANCELLED, which clients do not retry): a burst of thousands would lose some of its
        # refusals that way. The application's own admission (RESOURCE_EXHAUSTED with a reason) answers them.
        ("grpc.server.max_pending_requests", PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
    ]


def channel_options() -> list[tuple[str, Any]]:
    """Options of every gRPC channel of the mesh: keepalive without calls, and a reconnect backoff bounded by
    ``DEEPINFER_RECONNECT_MAX_BACKOFF_S`` (gRPC's own grows to 120 s)."""
    every, timeout = _keepalive_ms()
    max_backoff = max(1, int(envs.DEEPINFER_RECONNECT_MAX_BACKOFF_S * 1000))
    first = min(max_backoff, int(INITIAL_BACKOFF_S * 1000))
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", every),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", first),
        ("grpc.min_reconnect_backoff_ms", first),
        ("grpc.max_reconnect_backoff_ms", max_backoff),
    ]


def internal_token() -> str | None:
    """The mesh's shared internal secret: ``DEEPINFER_INTERNAL_TOKEN``, else the first line of
    ``DEEPINFER_INTERNAL_TOKEN_FILE``, else None."""
    token = envs.DEEPINFER_INTERNAL_TOKEN
    if token:
        return token.strip()
    path = envs.DEEPINFER_INTERNAL_TOKEN_FILE
    if path is not None:
        lines = path.read_text().splitlines()
        if lines and lines[0].strip():
            return lines[0].strip()
        raise ValueError(f"DEEPINFER_INTERNAL_TOKEN_FILE: {path} holds no token")
    return None


def internal_metadata() -> list[tuple[str, str]]:
    """The metadata every internal call carries (empty without a token)."""
    token = internal_token()
    return [(INTERNAL_HEADER, token)] if token else []


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


class _Credential:
    """Adds the internal token to a call's metadata (one subclass per call kind: a channel files an interceptor
    under the first kind it is an instance of)."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.metadata = list(metadata)

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, md, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_Credential, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with(details), request)


class _UnaryStream(_Credential, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with(details), request)


class _StreamUnary(_Credential, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._with(details), request_iterator)


class _StreamStream(_Credential, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._with(details), request_iterator)


def credential_interceptors(metadata: Sequence[tuple[str, str]]) -> list[Any]:
    """Interceptors adding ``metadata`` to every call of a channel, whatever its kind."""
    return [kind(metadata) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def open_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An aio channel to a service of the mesh: the mesh's options (``options`` override them by name), TLS with
    this service's certificate when configured (:mod:`deepinfer.rpc.tls`) and the internal credential on every
    call. Open it inside the event loop that uses it."""
    merged = dict(channel_options())
    merged.update(dict(options))
    md = internal_metadata()
    return client_channel(address, list(merged.items()), credential_interceptors(md) if md else None)


def client_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] | None = None
) -> grpc.aio.Channel:
    """An aio channel that speaks TLS when ``DEEPINFER_TLS_CA`` is set (presenting ``DEEPINFER_TLS_CERT`` when
    set), else plaintext; without the internal token (public clients: ``deepinfer generate``)."""
    creds = channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)


class Backoff:
    """Exponential backoff for reconnection loops: ``await backoff.wait()`` sleeps 0.1, 0.2, 0.4 ... s, up to
    ``DEEPINFER_RECONNECT_MAX_BACKOFF_S``; ``reset()`` after a success."""

    def __init__(self, initial_s: float = INITIAL_BACKOFF_S, max_s: float | None = None) -> None:
        self.initial_s = initial_s
        self.max_s = envs.DEEPINFER_RECONNECT_MAX_BACKOFF_S if max_s is None else max_s
        self.next_s = min(initial_s, self.max_s)

    async def wait(self) -> None:
        import asyncio

        await asyncio.sleep(self.next_s)
        self.next_s = min(self.next_s * 2, self.max_s)

    def reset(self) -> None:
        self.next_s = min(self.initial_s, self.max_s)
