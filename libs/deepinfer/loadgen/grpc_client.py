"""The gRPC client of the load generator: ``deepinfer.v1.Generation/Generate``, streamed (TLS when
``DEEPINFER_TLS_CA`` is set, as every client channel of the mesh; an API key as ``authorization`` metadata). Token-id
prompts go as ``token_ids``, chat prompts as ``chat``; each streamed message's ``token_ids`` are the token counts."""

from __future__ import annotations

from typing import Any

import grpc

from deepinfer.loadgen.outcome import Outcome
from deepinfer.loadgen.workload import Turn


class GrpcClient:
    def __init__(self, address: str, model: str, chat: bool, api_key: str | None = None, timeout_s: float = 600.0):
        self.address, self.model, self.chat, self.timeout_s = address, model, chat, timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel: Any = None
        self._stub: Any = None

    async def __aenter__(self) -> GrpcClient:
        from deepinfer.rpc.channel import client_channel
        from deepinfer.v1 import generation_pb2_grpc

        self._channel = client_channel(self.address)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()

    def request(self, turn: Turn, history: list[dict[str, str]], params: dict[str, Any]) -> Any:
        from deepinfer.v1 import common_pb2, generation_pb2

        params = dict(params)
        session = params.pop("user", "")  # (the OpenAI name) the request's session, for session-affine routing
        sampling = common_pb2.SamplingParams(max_tokens=turn.output_len, ignore_eos=True, **params)
        kw = {"sampling": sampling, "model": self.model, "session_id": session}
        if self.chat:
            msgs = [generation_pb2.ChatMessage(**m) for m in [*history, {"role": "user", "content": turn.text}]]
            return generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput(messages=msgs), **kw)
        return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=turn.prompt_ids), **kw)

    async def send(self, out: Outcome, turn: Turn, history: list[dict[str, str]], params: dict[str, Any]) -> None:
        req = self.request(turn, history, params)
        out.begin()
        try:
            async for msg in self._stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
                if msg.prompt_tokens:
                    out.prompt_tokens = msg.prompt_tokens
                if msg.token_ids:
                    out.output_tokens += len(msg.token_ids)
                    out.piece(msg.text)
                if msg.HasField("finished"):
                    out.cached_tokens = msg.finished.usage.cached_tokens
                    out.cached_by_tier = dict(msg.finished.usage.cached_tokens_by_tier)
        except grpc.aio.AioRpcError as e:
            out.end(f"{e.code().name}: {e.details()}")
            return
        out.end()


__all__ = ["GrpcClient"]
