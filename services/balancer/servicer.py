"""The public ``deepinfer.v1.Generation`` gRPC API: an adapter over :class:`~services.balancer.core.Balancer`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from deepinfer.serving.errors import Overloaded
from deepinfer.serving.metrics import observe_stream
from deepinfer.serving.server import status_for
from deepinfer.serving.tracing import extract_metadata
from deepinfer.v1 import generation_pb2, generation_pb2_grpc
from services.balancer.admission import public_status
from services.balancer.core import Balancer

PUBLIC = ("deepinfer.v1.Generation",)  # the balancer's services that take API keys (the rest: internal token)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    GRPC_ROUTE = "/deepinfer.v1.Generation/Generate"  # the route label of gRPC requests in the metrics

    def __init__(self, core: Balancer) -> None:
        self.core = core

    async def Generate(  # noqa: N802
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        core = self.core
        try:
            ticket = core.gate.admit(draining=core.draining)  # every replica full: RESOURCE_EXHAUSTED at once
        except Overloaded as e:
            core.metrics.count_request(core.info.model, self.GRPC_ROUTE, "resource_exhausted")
            await context.abort(*status_for(e))
        stream = observe_stream(
            core.generate(request, context.time_remaining(), extract_metadata(context.invocation_metadata())),
            model=core.info.model,
            route=self.GRPC_ROUTE,
            metrics=core.metrics,
        )
        try:
            async for out in stream:
                yield out
        except ValueError as e:
            await context.abort(*status_for(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(*public_status(e))
        finally:
            ticket.release()
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
