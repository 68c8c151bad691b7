"""The guards at the HTTP edge of the balancer: API keys and the request body's size.

* :class:`ApiKeyMiddleware`: when API keys are configured (``DEEPINFER_API_KEYS`` / ``DEEPINFER_API_KEY_FILE``,
  :class:`deepinfer.rpc.auth.ApiKeys`) every route but the probes and ``/metrics`` / ``/version``
  (:data:`OPEN_PATHS`) needs ``Authorization: Bearer KEY``; without a valid one the answer is 401 with an OpenAI
  error body (``type: authentication_error``, ``code: invalid_api_key``), before anything else runs.
* :func:`check_length` / :func:`read_body`: a body larger than ``DEEPINFER_MAX_REQUEST_BYTES`` is refused
  (:class:`PayloadTooLarge`, HTTP 413): from ``Content-Length`` before a byte is read, and while reading a
  chunked body, so a huge body is never held in memory.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.rpc.auth import ApiKeys

OPEN_PATHS = frozenset({"/health", "/ready", "/live", "/metrics", "/version"})  # probes and scrapes: no key


class PayloadTooLarge(Exception):
    """The request body is over the limit (HTTP 413)."""

    def __init__(self, limit: int, length: int | None = None) -> None:
        size = f"{length} bytes" if length is not None else "more bytes than that"
        super().__init__(f"the request body is too large: {size}, at most {limit} bytes (DEEPINFER_MAX_REQUEST_BYTES)")


class ApiKeyMiddleware:
    """ASGI middleware: 401 for a request without a valid API key on any path outside :data:`OPEN_PATHS`."""

    def __init__(self, app: Any, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.keys.enabled and scope["path"] not in OPEN_PATHS:
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.keys.accepts(auth):
                message = "Incorrect API key provided." if auth else "No API key provided (Authorization: Bearer KEY)."
                body = {"error": {"message": message, "type": "authentication_error", "param": None,
                                  "code": "invalid_api_key"}}  # fmt: skip
                await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_length(request: Request, limit: int) -> None:
    """Refuse from the ``Content-Length`` header, before anything is read."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(limit, int(length))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it grows past ``limit`` bytes (a chunked body has no ``Content-Length``)."""
    check_length(request, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
