"""The OpenAI error bodies of the HTTP API and the mapping of every error a request can meet to one.

``api_error`` maps validation errors (pydantic, ValueError naming the field) to 400 with ``param``, a body over
the limit to 413, the admission gate's refusal and a replica's RESOURCE_EXHAUSTED to 429 (``Retry-After``), a
replica gone or one that cancelled the request to 503, a deadline to 504, a request the engine failed (a replica's
INTERNAL with ``constraint.grammar: ...``: the worker could not enforce its grammar) to 500 with that reason and
code ``constraint_failed``, anything else to a generic 500.
"""

from __future__ import annotations

import re
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deepinfer.serving.errors import Overloaded, Unavailable
from deepinfer.serving.server import status_for
from deepinfer.telemetry import get_logger
from services.balancer.admission import public_status
from services.balancer.http_guard import PayloadTooLarge

log = get_logger(__name__)

_PARAM = re.compile(r"^(?:chat\.)?([A-Za-z_][\w.]*(?:\[\d+\][\w.]*)*)(?::| must | is )")
# gRPC status of a replica error -> (HTTP status, error type, code)
_RPC_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}
_GRPC_OF_HTTP = {status: code for code, (status, _, _) in _RPC_ERRORS.items()} | {
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
}  # for the metrics' status label


class ApiError(Exception):
    """An error with its OpenAI body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.grpc_status = _GRPC_OF_HTTP.get(status, grpc.StatusCode.INTERNAL)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None  # both are worth a retry
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def api_error(exc: BaseException) -> ApiError:
    """The OpenAI error for an exception of validation, of ``generate`` or of the replica."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        if err["type"] == "extra_forbidden":  # (OpenAI's wording for a field it does not know)
            return ApiError(400, f"{param}: unrecognized request argument", param=param, code="unknown_parameter")
        return ApiError(400, f"{param}: {err['msg']}", param=param or None, code="invalid_value")
    if isinstance(exc, ValueError):
        match = _PARAM.match(str(exc))
        return ApiError(400, str(exc), param=match.group(1) if match else None, code="invalid_value")
    if isinstance(exc, PayloadTooLarge):
        return ApiError(413, str(exc), code="request_too_large")
    if isinstance(exc, Overloaded | Unavailable):  # the admission gate's refusal, a replica gone
        status, type_, code = _RPC_ERRORS[status_for(exc)[0]]
        return ApiError(status, str(exc), type_, None, code)
    if isinstance(exc, grpc.aio.AioRpcError):  # a replica's CANCELLED is retryable: 503, never a 500
        grpc_code, details = public_status(exc)
        if grpc_code in _RPC_ERRORS:
            status, type_, code = _RPC_ERRORS[grpc_code]
            match = _PARAM.match(details) if status == 400 else None
            return ApiError(status, details, type_, match.group(1) if match else None, code)
        if grpc_code == grpc.StatusCode.INTERNAL and details.startswith("constraint."):  # the grammar failed
            return ApiError(500, details, "server_error", None, "constraint_failed")
    log.error("http_internal_error", exc_info=exc)
    return ApiError(500, "internal error", "server_error", code="internal_error")
