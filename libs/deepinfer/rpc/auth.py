"""Who may call what: API keys for the public APIs, the internal token for everything else, and strict
decoding of requests.

* Public services (``deepinfer.v1.Generation``) take an API key (``authorization: Bearer KEY`` metadata, the
  HTTP header on the OpenAI API) when keys are configured (:class:`ApiKeys`).
* Every other service of the mesh takes the internal token (``x-deepinfer-internal`` metadata) when one is
  configured (:func:`deepinfer.rpc.channel.internal_token`); its admin RPCs (Drain, LoadModel, kvstore Put /
  Delete) are simply among them.
* Health checking and reflection stay open (probes of orchestrators carry no credential).
* A request that does not decode as its message is refused with INVALID_ARGUMENT (gRPC's own decoding would
  answer UNKNOWN with the decoder's exception text).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from deepinfer import envs
from deepinfer.rpc.channel import INTERNAL_HEADER, internal_token

OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})  # fmt: skip


class ApiKeys:
    """The public API keys: ``DEEPINFER_API_KEYS`` plus the lines of ``DEEPINFER_API_KEY_FILE`` (re-read when the
    file changes, so keys rotate without a restart). ``enabled`` is False when neither is set."""

    def __init__(self, keys: Iterable[str] | None = None, path: Path | None = None) -> None:
        if keys is None:
            raw = envs.DEEPINFER_API_KEYS or ""
            keys = [k.strip() for k in raw.split(",") if k.strip()]
            path = envs.DEEPINFER_API_KEY_FILE if path is None else path
        self.static = [k.encode() for k in keys]
        self.path = path
        self._file_keys: list[bytes] = []
        self._stamp: tuple[int, int] | None = None
        self._reload()

    @property
    def enabled(self) -> bool:
        return bool(self.static) or self.path is not None

    def _reload(self) -> None:
        if self.path is None:
            return
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            lines = self.path.read_text().splitlines()
            self._file_keys = [s.strip().encode() for s in lines if s.strip() and not s.lstrip().startswith("#")]
            self._stamp = stamp

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value (``Bearer KEY``) names a valid key (always True when keys are off)."""
        if not self.enabled:
            return True
        if not authorization or not authorization[:7].lower() == "bearer ":
            return False
        given = authorization[7:].strip().encode()
        try:
            self._reload()
        except OSError:
            pass  # a file being replaced: keep the keys read last
        found = False
        for key in (*self.static, *self._file_keys):
            found |= hmac.compare_digest(given, key)  # no early exit: the time does not tell which key is close
        return found


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


class ServerGuard(grpc.aio.ServerInterceptor):
    """Authentication and strict decoding for one gRPC server.

    ``public``: the full names of the services that take API keys; every other service (but health and reflection)
    takes the internal token."""

    def __init__(self, public: Iterable[str] = (), keys: ApiKeys | None = None, token: str | None = None) -> None:
        self.public = frozenset(public)
        self.keys = keys if keys is not None else ApiKeys()
        self.token = token if token is not None else internal_token()

    def allowed(self, service: str, metadata: Iterable[tuple[str, Any]]) -> str | None:
        """None when the call may go on, else why not."""
        if service in OPEN_SERVICES:
            return None
        md = {k: v for k, v in metadata if isinstance(v, str)}
        if service in self.public:
            if self.keys.accepts(md.get("authorization")):
                return None
            return "a valid API key is required (metadata authorization: Bearer KEY)"
        if self.token is None or token_matches(md.get(INTERNAL_HEADER), self.token):
            return None
        return f"{service} is internal: the mesh's internal token is required"

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        service = details.method.split("/")[1] if details.method.count("/") >= 2 else ""
        refusal = self.allowed(service, details.invocation_metadata or ())
        return _strict(handler) if refusal is None else _refuse(handler, refusal)


def _refuse(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return _replace(handler, deny, None)


def _strict(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler, fed raw bytes that it decodes itself: a malformed message → INVALID_ARGUMENT."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

    if handler.request_streaming:

        async def messages(raw: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            async for data in raw:
                yield _decode(parse, data)

        if handler.response_streaming:

            async def run(request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for out in behaviour(messages(request_iterator), context):
                    yield out

            return _replace(handler, run, None)

        async def run_unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(messages(request_iterator), context)

        return _replace(handler, run_unary, None)

    async def parsed(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return _decode(parse, data)
        except MalformedRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    if handler.response_streaming:

        async def run_stream(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await parsed(data, context)
            async for out in behaviour(request, context):
                yield out

        return _replace(handler, run_stream, None)

    async def run_one(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await parsed(data, context), context)

    return _replace(handler, run_one, None)


class MalformedRequest(ValueError):
    """A request's bytes are not its message (mapped to INVALID_ARGUMENT)."""


def _decode(parse: Any, data: bytes) -> Any:
    try:
        return parse(data)
    except (DecodeError, ValueError, TypeError) as e:
        raise MalformedRequest(f"request: not a valid protobuf message ({type(e).__name__})") from None


def _replace(handler: grpc.RpcMethodHandler, behaviour: Any, deserializer: Any) -> grpc.RpcMethodHandler:
    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(behaviour, request_deserializer=deserializer, response_serializer=handler.response_serializer)
