"""The balancer: the public ``deepinfer.v1.Generation`` API in front of scheduler replicas.

It tokenizes (text, token ids, or chat messages through the DeepSeek-V4 chat encoding), validates,
picks a replica (least in-flight requests, ties round-robin), streams the replica's tokens back as
text deltas (incremental detokenization: never a partial UTF-8 character; text that could still
become a stop string is held back), applies stop strings (cancelling the replica's stream, which
frees the request's pages), and ends with the finish reason and usage.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from deepinfer.chat import encode_messages
from deepinfer.engine.determinism import merge as merge_determinism
from deepinfer.rpc.convert import determinism_from_proto, determinism_to_proto, sampling_from_proto
from deepinfer.serving.constraints import ConstraintCompiler
from deepinfer.serving.errors import ModelNotFound, Unavailable
from deepinfer.serving.metrics import METRICS, Metrics, finish_reason_name, observe_stream, status_label
from deepinfer.serving.server import CHANNEL_OPTIONS, status_for
from deepinfer.serving.tracing import extract_metadata, inject_metadata, request_attributes, tracer
from deepinfer.telemetry import get_logger
from deepinfer.tokenizer import Detokenizer
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = get_logger(__name__)
_tracer = tracer(__name__)


@dataclass
class Replica:
    address: str
    stub: scheduler_pb2_grpc.SchedulerStub
    in_flight: int = 0


def chat_to_messages(chat: generation_pb2.ChatInput) -> tuple[list[dict], list[dict] | None]:
    """The wire conversation as the OpenAI-style dicts the chat encoding takes."""
    messages = []
    for i, m in enumerate(chat.messages):
        d: dict = {"role": m.role, "content": m.content}
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        messages.append(d)
        if not m.role:
            raise ValueError(f"chat.messages[{i}].role: required")
    tools = None
    if chat.tools:
        tools = []
        for i, t in enumerate(chat.tools):
            try:
                params = json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
            except json.JSONDecodeError as e:
                raise ValueError(f"chat.tools[{i}].parameters: not valid JSON ({e})") from e
            tools.append(
                {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": params}}
            )
    return messages, tools


class GenerationService(generation_pb2_grpc.GenerationServicer):
    GRPC_ROUTE = "/deepinfer.v1.Generation/Generate"  # the route label of gRPC requests in the metrics

    def __init__(
        self,
        tokenizer: object,
        info: generation_pb2.ModelInfo,
        replicas: list[str],
        metrics: Metrics | None = None,
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        self.tokenizer, self.info, self.constraints = tokenizer, info, constraints
        self.metrics = metrics if metrics is not None else METRICS
        self.replicas: list[Replica] = []
        self.set_replicas(replicas)
        self._rr = itertools.count()
        self._where: dict[str, Replica] = {}

    def set_replicas(self, addresses: list[str]) -> None:
        """Route to exactly these scheduler replicas (kept ones keep their channel and counters)."""
        known = {r.address: r for r in self.replicas}
        wanted = list(dict.fromkeys(addresses))
        self.replicas = [
            known.get(a)
            or Replica(a, scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)))
            for a in wanted
        ]

    # -- helpers -------------------------------------------------------------------------------
    def _prompt(
        self, which: str | None, req: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest
    ) -> tuple[list[int], str | None, list[dict] | None]:
        """Prompt ids, prompt text and (chat) the tools it renders."""
        if which == "text":
            return self.tokenizer.encode(req.text, add_special_tokens=False).ids, req.text, None
        if which == "token_ids":
            return list(req.token_ids.ids), None, None
        if which == "chat":
            messages, tools = chat_to_messages(req.chat)
            text = encode_messages(
                messages,
                thinking_mode=req.chat.thinking_mode or "chat",
                reasoning_effort=req.chat.reasoning_effort or None,
                tools=tools,
            )
            return self.tokenizer.encode(text, add_special_tokens=False).ids, text, tools
        raise ValueError("input: one of text, token_ids or chat is required")

    async def _constraint(
        self, request: generation_pb2.GenerateRequest, ids: list[int], params: object, tools: list[dict] | None
    ) -> common_pb2.Constraint | None:
        if self.constraints is not None:
            return await self.constraints.build(request, ids, params, tools)
        if params.so_args is not None:
            raise Unavailable("so_args: this balancer has no grammar service (DEEPINFER_GRAMMAR_URL)")
        return None

    def _pick(self) -> Replica:
        if not self.replicas:
            raise Unavailable("no scheduler replica is registered")
        start = next(self._rr)
        order = self.replicas[start % len(self.replicas) :] + self.replicas[: start % len(self.replicas)]
        return min(order, key=lambda r: r.in_flight)

    # -- RPCs ----------------------------------------------------------------------------------
    async def generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None, parent: Context | None = None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The response stream of one request: shared by the gRPC and the HTTP front ends.

        Raises ValueError (naming the field) before anything is sent for a bad request, and the
        replica's ``grpc.aio.AioRpcError`` (RESOURCE_EXHAUSTED, UNAVAILABLE, ...) as it comes. The request
        is traced as one SERVER span (a child of ``parent``, if given) whose context goes to the replica."""
        op = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
        model = request.model or self.info.model
        span = _tracer.start_span(
            f"{op} {model}", context=parent, kind=trace.SpanKind.SERVER,
            attributes=request_attributes(op, model, request.sampling),
        )  # fmt: skip
        stream = self._generate(request, timeout, span)
        try:
            async for out in stream:
                if out.HasField("finished"):
                    span.set_attributes({
                        "gen_ai.response.id": out.request_id,
                        "gen_ai.usage.input_tokens": out.finished.usage.prompt_tokens,
                        "gen_ai.usage.output_tokens": out.finished.usage.completion_tokens,
                        "gen_ai.response.finish_reasons": [finish_reason_name(out.finished.reason)],
                    })  # fmt: skip
                yield out
        except BaseException as e:
            if not isinstance(e, GeneratorExit):
                span.set_attribute("error.type", status_label(e))
                span.set_status(trace.StatusCode.ERROR, str(e) or type(e).__name__)
            raise
        finally:
            await stream.aclose()  # the inner stream's cleanup (cancel the replica's call) runs now
            span.end()

    async def _generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None, span: trace.Span
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        if request.model and request.model != self.info.model:
            raise ModelNotFound(f"model: {request.model!r} is not served here (serving {self.info.model!r})")
        ids, _, tools = self._prompt(request.WhichOneof("input"), request)
        if not ids:
            raise ValueError("prompt: empty prompt (at least one token is required)")
        if len(ids) >= self.info.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens; the model's limit is {self.info.max_model_len}")
        params = sampling_from_proto(request.sampling)
        params.validate_for_model(self.info.vocab_size)
        try:
            with trace.use_span(span, end_on_exit=False):  # the grammar service's compile span is a child
                constraint = await self._constraint(request, ids, params, tools)
            replica = self._pick()
        except Unavailable as e:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), str(e)
            ) from e
        replica.in_flight += 1
        self._where[rid] = replica
        detok = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output)
        hold = max((len(s) for s in params.stop), default=1) - 1
        emitted, n_out, first = 0, 0, True
        call = replica.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id=rid,
                prompt_token_ids=ids,
                sampling=request.sampling,
                cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
                constraint=constraint,
            ),  # fmt: skip
            timeout=timeout,
            metadata=inject_metadata(trace.set_span_in_context(span)),
        )
        try:
            prompt_rows = []
            async for ev in call:
                prompt_rows.extend(ev.prompt_logprobs)  # a chunked prefill scores the prompt over several steps
                if first and not ev.token_ids and ev.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    continue  # the first message waits for the first token and carries the whole prompt's rows
                out = generation_pb2.GenerateResponse(request_id=rid)
                if first:
                    out.prompt_tokens = len(ids)
                    if prompt_rows:
                        out.prompt_logprobs.add()
                        for row in prompt_rows:
                            out.prompt_logprobs.add().entries.extend(row.entries)
                    first = False
                stop = None
                for k, t in enumerate(ev.token_ids):
                    n_out += 1
                    out.token_ids.append(t)
                    if k < len(ev.logprobs):
                        out.logprobs.append(ev.logprobs[k])
                    stop = detok.add(t, check_stop=n_out >= params.min_tokens)
                    if stop is not None:
                        break
                done = stop is not None or ev.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                upto = len(detok.text) if done else max(emitted, len(detok.text) - hold)
                out.text = detok.text[emitted:upto]
                emitted = upto
                if done:
                    f = out.finished
                    if stop is not None:
                        f.reason, f.stop_string = common_pb2.FINISH_REASON_STOP, stop
                    else:
                        f.reason = ev.finish_reason
                        if ev.stop_token_id and ev.finish_reason == common_pb2.FINISH_REASON_STOP:
                            f.stop_token_id = ev.stop_token_id
                    f.usage.prompt_tokens, f.usage.completion_tokens = len(ids), n_out
                    f.usage.total_tokens = len(ids) + n_out
                    f.usage.cached_tokens = ev.cached_tokens
                    if ev.cached_tokens and ev.cached_tier:
                        f.usage.cached_tokens_by_tier[ev.cached_tier] = ev.cached_tokens
                    yield out
                    return
                yield out
        finally:
            call.cancel()  # stop string or caller gone: the replica frees the request's pages
            replica.in_flight -= 1
            self._where.pop(rid, None)

    async def Generate(  # noqa: N802
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        stream = observe_stream(
            self.generate(request, context.time_remaining(), extract_metadata(context.invocation_metadata())),
            model=self.info.model,
            route=self.GRPC_ROUTE,
            metrics=self.metrics,
        )
        try:
            async for out in stream:
                yield out
        except ValueError as e:
            await context.abort(*status_for(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or e.code().name)
        finally:
            await stream.aclose()

    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        aborted = []
        for rid in request.request_ids:
            replica = self._where.get(rid)
            if replica is not None:
                res = await replica.stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_ids=[rid]), timeout=10)
                aborted += list(res.aborted)
        return generation_pb2.AbortResponse(aborted=aborted)

    async def Tokenize(  # noqa: N802
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        try:
            ids, text, _ = self._prompt(request.WhichOneof("input"), request)
        except ValueError as e:
            await context.abort(*status_for(e))
            return generation_pb2.TokenizeResponse()
        return generation_pb2.TokenizeResponse(token_ids=ids, prompt=text or "")

    async def GetModelInfo(  # noqa: N802
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        """The static model facts, plus what the replicas run (accelerator, dtype, determinism)."""
        found = []
        for r in self.replicas:
            try:
                found.append(await r.stub.GetReplicaInfo(scheduler_pb2.GetReplicaInfoRequest(), timeout=5))
            except grpc.aio.AioRpcError:
                continue  # a replica that is down or starting does not decide the answer
        info = generation_pb2.ModelInfo()
        info.CopyFrom(self.info)
        if found:
            d = merge_determinism([determinism_from_proto(r.determinism) for r in found])
            info.determinism.CopyFrom(determinism_to_proto(d))
            info.batch_invariant, info.deterministic_sampling = d.batch_invariant, d.deterministic_sampling
            info.accelerator = found[0].accelerator if len({r.accelerator for r in found}) == 1 else "mixed"
            info.dtype = found[0].dtype if len({r.dtype for r in found}) == 1 else "mixed"
        return info

    async def GetLoads(  # noqa: N802
        self, request: generation_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetLoadsResponse:
        out = generation_pb2.GetLoadsResponse()
        for r in self.replicas:
            try:
                load = await r.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                load = common_pb2.ReplicaLoad(draining=True)
            load.replica_id = r.address
            out.replicas.append(load)
        return out


async def run_balancer(
    model: str | None,
    schedulers: list[str],
    host: str,
    port: int,
    max_model_len: int | None,
    http_port: int | None = None,
) -> None:
    """Serve ``deepinfer.v1.Generation`` for the model in ``model`` (tokenizer and config only) and, with
    ``http_port``, the OpenAI-compatible HTTP API beside it; both drain and stop together on SIGTERM."""
    import asyncio

    from deepinfer import envs
    from deepinfer.engine.factory import resolve_model_dir
    from deepinfer.grammar import tokenizer_fingerprint
    from deepinfer.serving.server import Service, serve
    from deepinfer.tokenizer import load_tokenizer

    path, config = resolve_model_dir(model)
    tokenizer = load_tokenizer(path)
    constraints = ConstraintCompiler(
        tokenizer, envs.DEEPINFER_GRAMMAR_URL, tokenizer_fingerprint(path), envs.DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S
    )
    info = generation_pb2.ModelInfo(
        model=str(model or path),
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len or config.max_position_embeddings,
        eos_token_id=config.eos_token_id,
        structured_output_types=constraints.kinds,
    )
    service = GenerationService(tokenizer, info, schedulers, constraints=constraints)
    services = [Service("deepinfer.v1.Generation", service, generation_pb2_grpc.add_GenerationServicer_to_server)]
    from deepinfer.serving.discovery import Discovery

    discovery = Discovery(service, schedulers)
    try:
        await discovery.start()
        if http_port is None:
            await serve(services, host, port)
            return

        from deepinfer.serving.http import create_app, start_http

        app = create_app(service)
        http, task = await start_http(app, host, http_port)  # listening before gRPC reports SERVING

        async def drain(grace_s: float) -> None:  # health 503, refuse new requests, let open ones finish
            app.state.api.draining = True
            while app.state.api.in_flight:
                await asyncio.sleep(0.05)

        try:
            await serve(services, host, port, on_drain=drain)
        finally:
            http.should_exit = True
            await task
    finally:
        await discovery.close()
        await constraints.close()
