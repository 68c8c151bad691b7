"""The public ``deepinfer.v1.Generation`` gRPC API: an adapter over :class:`~services.balancer.core.Balancer`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc

from deepinfer.serving.errors import Overloaded
from deepinfer.serving.metrics import observe_stream, status_label
from deepinfer.serving.server import status_for
from deepinfer.serving.tracing import extract_metadata
from deepinfer.v1 import generation_pb2, generation_pb2_grpc
from services.balancer.admission import public_status
from services.balancer.core import Balancer
from services.balancer.samples import check_n, generate_samples

PUBLIC = ("deepinfer.v1.Generation",)  # the balancer's services that take API keys (the rest: internal token)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    GRPC_ROUTE = "/deepinfer.v1.Generation/Generate"  # the route label of gRPC requests in the metrics

    def __init__(self, core: Balancer) -> None:
        self.core = core

    async def Generate(  # noqa: N802
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        core, tickets = self.core, []
        try:
            n = check_n(request)
        except ValueError as e:
            core.metrics.count_request(core.info.model, self.GRPC_ROUTE, status_label(e))
            await context.abort(*status_for(e))
        try:
            for _ in range(n):  # a place per sample; every replica full: RESOURCE_EXHAUSTED at once
                tickets.append(core.gate.admit(draining=core.draining))
        except Overloaded as e:
            for ticket in tickets:
                ticket.release()
            core.metrics.count_request(core.info.model, self.GRPC_ROUTE, "resource_exhausted")
            await context.abort(*status_for(e))
        parent = extract_metadata(context.invocation_metadata())

        def open_(sample: generation_pb2.GenerateRequest, timeout: float | None, **route: object) -> AsyncIterator:
            gen = core.generate(sample, timeout, parent, **route)  # n == 1: no routing arguments
            return observe_stream(gen, model=core.info.model, route=self.GRPC_ROUTE, metrics=core.metrics)

        if n == 1:
            stream = open_(request, context.time_remaining())
        else:
            request.request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
            core.samples[request.request_id] = n  # Abort(id) aborts every sample
            stream = generate_samples(request, n, open_, core.replica_of, context.time_remaining())
        try:
            async for out in stream:
                yield out
        except ValueError as e:
            await context.abort(*status_for(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(*public_status(e))
        finally:
            for ticket in tickets:
                ticket.release()
            if n > 1:
                core.samples.pop(request.request_id, None)
            await stream.aclose()

    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        return generation_pb2.AbortResponse(aborted=await self.core.abort(list(request.request_ids)))

    async def Tokenize(  # noqa: N802
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        try:
            ids, text, _ = await asyncio.to_thread(self.core.prompt, request.WhichOneof("input"), request)
        except ValueError as e:
            await context.abort(*status_for(e))
            return generation_pb2.TokenizeResponse()
        return generation_pb2.TokenizeResponse(token_ids=ids, prompt=text or "")

    async def GetModelInfo(  # noqa: N802
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        """The static model facts, plus what the replicas run (accelerator, dtype, determinism)."""
        return await self.core.model_info()

    async def GetLoads(  # noqa: N802
        self, request: generation_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetLoadsResponse:
        return await self.core.loads()
