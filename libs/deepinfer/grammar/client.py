"""The client of the grammar service (``deepinfer.v1.Grammar``), for the balancer.

It fails fast: no waiting for a connection (``wait_for_ready=False``), so with the service down a compile
raises :class:`GrammarUnavailable` at once and the request it serves can be refused with UNAVAILABLE.
Status codes: INVALID_ARGUMENT → :class:`GrammarError`, DEADLINE_EXCEEDED → :class:`GrammarTimeout` (a
:class:`GrammarError`), both with the service's reason; anything else (UNAVAILABLE, FAILED_PRECONDITION for a
tokenizer mismatch, INTERNAL, ...) → :class:`GrammarUnavailable`.
"""

from __future__ import annotations

import grpc

from deepinfer.grammar.spec import CompiledGrammar, GrammarError, GrammarSpec, GrammarTimeout, GrammarUnavailable
from deepinfer.grammar.wire import grammar_from_proto, kind_to_proto
from deepinfer.rpc.channel import open_channel
from deepinfer.serving.tracing import inject_metadata
from deepinfer.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc

__all__ = ["GrammarClient"]

# The service's time limit runs from when a compile process takes the grammar; the RPC deadline leaves
# room for queueing and the transfer of the compiled grammar.
DEADLINE_MARGIN_S = 1.0
# Fail-fast calls fail at once while the channel waits to reconnect: keep that wait short, so a restarted
# service serves constrained requests again within about a second (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class GrammarClient:
    """``await GrammarClient("host:port").compile(spec)`` -> :class:`CompiledGrammar` (the channel opens lazily,
    inside the caller's event loop)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: grammar_pb2_grpc.GrammarStub | None = None

    def _connect(self) -> grammar_pb2_grpc.GrammarStub:
        if self._stub is None:
            self._channel = open_channel(self.address, RECONNECT_OPTIONS)
            self._stub = grammar_pb2_grpc.GrammarStub(self._channel)
        return self._stub

    async def compile(
        self, spec: GrammarSpec, tokenizer_fingerprint: str = "", timeout_s: float = 5.0
    ) -> CompiledGrammar:
        """Compile ``spec`` in the service within ``timeout_s`` (its compile limit; the RPC gets a margin more)."""
        request = grammar_pb2.CompileRequest(
            structured_output=common_pb2.StructuredOutput(schema_type=kind_to_proto(spec.kind), schema=spec.text),
            tokenizer_fingerprint=tokenizer_fingerprint,
            timeout_s=timeout_s,
        )
        deadline = timeout_s + DEADLINE_MARGIN_S
        try:
            response = await self._connect().Compile(
                request, timeout=deadline, wait_for_ready=False, metadata=inject_metadata()
            )
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise GrammarError(details) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                if details == "Deadline Exceeded":  # our own deadline, not the service's compile limit
                    details = f"{spec.kind}: the grammar service did not answer within {deadline:g} s"
                raise GrammarTimeout(details) from None
            raise GrammarUnavailable(f"grammar service at {self.address}: {code.name}: {details}") from None
        return grammar_from_proto(response.grammar)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
