"""The OpenAI-compatible HTTP API of the balancer (the routes and error bodies vLLM serves), over
``Balancer.generate``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``/health`` (and
``/ready``; 503 once draining or while no replica serves), ``/live``, ``/metrics`` and ``/version``. With API keys
configured every route but the probes, ``/metrics`` and ``/version`` needs one (401 otherwise). A request is
refused before its body is read when the server drains (503), the body is too large (413) or every replica is
full (429 + ``Retry-After``, the admission gate); its JSON is parsed and its chat prompt rendered off the event
loop. It is validated and its first response awaited before the HTTP status is sent, so bad input, a full queue
or a dead replica get a proper status and an OpenAI error body; an error after a stream has started is sent as a
``data: {"error": ...}`` event. A client that goes away closes the upstream stream, which cancels the replica's
request and frees its pages. A request with ``n`` > 1 runs as ``n`` samples (:mod:`.http_choices`), each with a place
at the gate: the first alone, the others once it has produced its first token, on its replica (whose prefix cache
then holds the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer import __version__, envs
from deepinfer.chat.streaming import StreamingParser
from deepinfer.rpc.auth import ApiKeys
from deepinfer.serving.metrics import (
    CONTENT_TYPE_LATEST,
    METRICS,
    Metrics,
    finish_reason_name,
    observe_stream,
    status_label,
)
from deepinfer.v1 import generation_pb2
from services.balancer.chat_output import parse_chat_output
from services.balancer.core import Balancer
from services.balancer.http_choices import (
    collect,
    merge,
    openai_deltas,
    sample_requests,
    summed_usage,
    text_choice,
    tool_call,
    with_usage,
)
from services.balancer.http_errors import ApiError, api_error
from services.balancer.http_guard import ApiKeyMiddleware, check_length, read_body
from services.balancer.openai_protocol import ChatCompletionRequest, CompletionRequest
from services.balancer.sse import EventStream, framed, hang_up


def _finish(out: generation_pb2.GenerateResponse) -> str:
    reason = finish_reason_name(out.finished.reason)
    if reason == "error":
        raise ApiError(500, "the engine failed the request", "server_error", code="internal_error")
    return reason


class _Api:
    """The route handlers over one ``Balancer`` (the balancer's core)."""

    def __init__(self, service: Balancer, metrics: Metrics) -> None:
        self.service, self.metrics, self.info = service, metrics, service.info
        self._image_placeholder = getattr(service, "image_placeholder", None)  # None: the model takes no images
        self.draining, self.in_flight, self.created = False, 0, int(time.time())
        self.gate = getattr(service, "gate", None)  # the admission gate (None: not gated here)
        self.max_body = envs.DEEPINFER_MAX_REQUEST_BYTES
        self._tokens: dict[int, str] = {}
        tok = getattr(service.tokenizer, "token_to_id", None)
        self.think_end_id = tok("</think>") if tok is not None else None

    # -- helpers -----------------------------------------------------------------------------------
    def token(self, tid: int) -> str:
        if tid not in self._tokens:
            self._tokens[tid] = self.service.tokenizer.decode([tid], skip_special_tokens=False)
        return self._tokens[tid]

    def _entry(self, tid: int, lp: float) -> dict[str, Any]:
        t = self.token(tid)
        return {"token": t, "logprob": max(lp, -9999.0), "bytes": list(t.encode())}

    def chat_logprobs(self, lps: Any) -> list[dict[str, Any]]:
        return [
            self._entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [self._entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in lps
        ]

    def completion_logprobs(self, lps: Any, offset: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            t = self.token(lp.token_id)
            out["tokens"].append(t)
            out["token_logprobs"].append(max(lp.logprob, -9999.0))
            top = {self.token(x.token_id): max(x.logprob, -9999.0) for x in lp.top}
            out["top_logprobs"].append(top or {t: max(lp.logprob, -9999.0)})
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def reasoning_tokens(self, ids: list[int], reasoning: bool) -> int | None:
        if not reasoning:
            return None
        return ids.index(self.think_end_id) if self.think_end_id in ids else len(ids)

    def _admit(self, request: Request) -> Any:
        """Refusals that cost nothing, before the body is read: draining, too large, every replica full."""
        if self.draining:
            raise ApiError(503, "the server is draining", "service_unavailable_error", code="service_unavailable")
        check_length(request, self.max_body)
        return self.gate.admit() if self.gate is not None else None

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request, self.max_body)
        return await asyncio.to_thread(self._decode, raw, model)  # a big body's JSON: off the event loop

    def _decode(self, raw: bytes, model: type[BaseModel]) -> Any:
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the request body is not valid UTF-8 ({e})", code="invalid_json") from None
        except json.JSONDecodeError as e:
            raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the JSON body is nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        req = model.model_validate(body)
        if req.model and req.model != self.info.model:
            raise ApiError(404, f"model {req.model!r} does not exist (serving {self.info.model!r})", param="model",
                           code="model_not_found")  # fmt: skip
        return req

    async def _run(
        self, request: Request, route: str, model: type[BaseModel],
        start: Callable[[Any, str], tuple[generation_pb2.GenerateRequest, Any]], respond: Callable[..., Any],
    ) -> Response:  # fmt: skip
        """Parse, start the samples' streams and await their first responses (errors up to then are JSON errors),
        then ``respond(req, rid, firsts, streams, ctx)`` with a JSON body or an SSE generator of events. A client
        that goes away before its response starts cancels the request (its places at the gate and on the replica)."""
        streams: list[Any] = []
        streaming, tickets, watch = False, [], None
        self.in_flight += 1
        try:
            tickets.append(self._admit(request))
            req = await self._parse(request, model)
            watch = asyncio.create_task(hang_up(request, asyncio.current_task()))
            rid = f"{'chatcmpl' if model is ChatCompletionRequest else 'cmpl'}-{uuid.uuid4().hex}"
            grpc_req, ctx = await asyncio.to_thread(start, req, rid)  # chat rendering: off the event loop
            grpc_req.session_id = request.headers.get("x-session-id") or req.user or ""  # (routing: docs/routing.md)
            samples = sample_requests(grpc_req, req.n)
            for _ in samples[1:] if self.gate is not None else ():
                tickets.append(self.gate.admit())  # a place per sample
            firsts = await self._open(samples, route, streams)
            body = await respond(req, rid, firsts, streams, ctx)
            if isinstance(body, dict):
                return JSONResponse(body)
            streaming = True
            watch.cancel()  # the event stream watches for the client itself
            return EventStream(framed(body), partial(self._close, streams, tickets))
        except asyncio.CancelledError:
            if watch is None or watch.cancelled() or not watch.done():
                raise
            asyncio.current_task().uncancel()  # the client is gone: nobody reads what follows
            if not streams:
                self.metrics.count_request(self.info.model, route, "cancelled")
            return Response(status_code=499)
        except Exception as e:
            err = api_error(e)
            if not streams:
                self.metrics.count_request(self.info.model, route, status_label(err))
            return err.response()
        finally:
            if watch is not None:
                watch.cancel()
            if not streaming:
                await self._close(streams, tickets)

    async def _open(self, samples: list[generation_pb2.GenerateRequest], route: str, streams: list[Any]) -> list[Any]:
        """Start the samples' streams (into ``streams``, for the caller to close) and await each first response:
        the first sample's, then the others', sent to the first one's replica while it is routable."""

        def observe(sample: generation_pb2.GenerateRequest, **routing: Any) -> Any:
            gen = self.service.generate(sample, **routing)  # n == 1: no routing arguments
            return observe_stream(gen, model=self.info.model, route=route, metrics=self.metrics)

        # with n > 1 the first sample keeps a resume point that the others resume from, on its replica
        streams.append(observe(samples[0], **({"shared": True} if len(samples) > 1 else {})))
        firsts = [await anext(streams[0])]
        if len(samples) > 1:
            prefer = self.service.replica_of(samples[0].request_id)
            streams += [observe(sample, prefer=prefer) for sample in samples[1:]]
            got = await asyncio.gather(*(anext(s) for s in streams[1:]), return_exceptions=True)
            for g in got:
                if isinstance(g, BaseException):
                    raise g
            firsts += got
        return firsts

    async def _close(self, streams: list[Any], tickets: list[Any]) -> None:
        self.in_flight -= 1
        for ticket in tickets:
            if ticket is not None:
                ticket.release()
        for stream in streams:
            await stream.aclose()

    # -- completions -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._run(
            request, "/v1/completions", CompletionRequest, lambda req, rid: (req.to_proto(rid), None), self._completion
        )

    async def _completion(self, req: CompletionRequest, rid: str, firsts: list, streams: list, _: None) -> Any:
        want_lp = req.logprobs is not None
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.info.model}
        if not req.stream:
            choices = []
            for i, outs in enumerate(samples := await collect(firsts, streams)):
                lp = self.completion_logprobs([x for o in outs for x in o.logprobs], 0) if want_lp else None
                choices.append(text_choice(i, "".join(o.text for o in outs), lp, _finish(outs[-1])))
            return head | {"choices": choices, "usage": summed_usage([o[-1].finished.usage for o in samples])}
        extra = {"usage": None} if req.include_usage else {}
        usages: list[Any] = [None] * len(streams)

        async def events(i: int) -> AsyncIterator[dict[str, Any]]:
            offset, out = 0, firsts[i]
            while out is not None:
                done = out.HasField("finished")
                lp = self.completion_logprobs(out.logprobs, offset) if want_lp and out.logprobs else None
                offset += len(out.text)
                if out.text or lp or done:
                    yield head | {"choices": [text_choice(i, out.text, lp, _finish(out) if done else None)]} | extra
                if done:
                    usages[i] = out.finished.usage
                out = await anext(streams[i], None)

        return with_usage(req.include_usage, head, merge([events(i) for i in range(len(streams))]), usages)

    # -- chat completions --------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._run(
            request, "/v1/chat/completions", ChatCompletionRequest,
            lambda req, rid: req.to_proto(rid, self.info.max_model_len, self._image_placeholder), self._chat,
        )  # fmt: skip

    async def _chat(self, req: ChatCompletionRequest, rid: str, firsts: list, streams: list, reasoning: bool) -> Any:
        """``reasoning``: the rendered prompt opened reasoning (it ends with ``<think>``)."""
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.info.model}
        if not req.stream:
            samples = await collect(firsts, streams)
            choices = [self._chat_choice(req, i, outs, reasoning) for i, outs in enumerate(samples)]
            ids = [[t for o in outs for t in o.token_ids] for outs in samples]
            usage = summed_usage(
                [o[-1].finished.usage for o in samples], [self.reasoning_tokens(x, reasoning) for x in ids]
            )
            return head | {"choices": choices, "usage": usage}
        head["object"] = "chat.completion.chunk"
        extra = {"usage": None} if req.include_usage else {}
        usages: list[Any] = [None] * len(streams)
        reasoning_tokens: list[int | None] = [None] * len(streams)

        async def events(i: int) -> AsyncIterator[dict[str, Any]]:
            def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
                return (
                    head | {"choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]} | extra
                )

            # each tool call is sent whole once it closes: a call cut short (max_tokens) is never sent
            parser, ids, out = StreamingParser("thinking" if reasoning else "chat", whole_calls=True), [], firsts[i]
            yield chunk({"role": "assistant", "content": ""})
            while out is not None:
                ids += out.token_ids
                done = out.HasField("finished")
                deltas = parser.feed(out.text) + (parser.finish() if done else [])
                lp = {"content": self.chat_logprobs(out.logprobs)} if req.logprobs and out.logprobs else None
                for k, delta in enumerate(openai_deltas(deltas)):
                    yield chunk(delta, lp=lp if k == 0 else None)
                    lp = None
                if lp:
                    yield chunk({}, lp=lp)
                if done:
                    finish = _finish(out)
                    if parser.tool_call_count and finish == "stop" and not parser.unfinished_call:
                        finish = "tool_calls"
                    yield chunk({}, finish)
                    usages[i], reasoning_tokens[i] = out.finished.usage, self.reasoning_tokens(ids, reasoning)
                out = await anext(streams[i], None)

        gens = [events(i) for i in range(len(streams))]
        return with_usage(req.include_usage, head, merge(gens), usages, reasoning_tokens)

    def _chat_choice(self, req: ChatCompletionRequest, i: int, outs: list, reasoning: bool) -> dict[str, Any]:
        """One sample's choice: a tool call cut short (``length``) is dropped; ``tool_calls`` only on a normal stop."""
        finish = _finish(outs[-1])
        r, content, calls = parse_chat_output("".join(o.text for o in outs), reasoning, finish)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if req.thinking()[0]:
            message["reasoning_content"] = message["reasoning"] = r
        if calls:
            message["tool_calls"] = [tool_call(c) for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        lp = {"content": self.chat_logprobs([x for o in outs for x in o.logprobs])} if req.logprobs else None
        return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}

    # -- other routes ------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        card = {"id": self.info.model, "object": "model", "created": self.created, "owned_by": "deepinfer",
                "root": self.info.model, "max_model_len": self.info.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        """/health and /ready: 503 while draining or while no replica could serve a request."""
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        ready = getattr(self.service, "ready", None)
        if ready is not None and not ready():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def live(self) -> Response:
        """/live: 200 while the process serves (draining included)."""
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> dict[str, str]:
        return {"version": __version__}


def create_app(service: Balancer, metrics: Metrics | None = None, keys: ApiKeys | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``service``; ``app.state.api.draining = True`` turns /health to 503. With API
    keys (``keys``, default from the environment) every route but the probes needs ``Authorization: Bearer KEY``."""
    # FastAPI's own OpenTelemetry spans and metrics off (the request's span is the service's own, with the GenAI
    # attributes; FastAPI's cost about 0.5 ms of the event loop per request, a third of a refusal under a burst)
    off = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(title="deepinfer", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=off)  # fmt: skip
    app.add_middleware(ApiKeyMiddleware, keys=keys if keys is not None else ApiKeys())
    api = app.state.api = _Api(service, metrics or METRICS)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    for path in ("/health", "/ready"):
        app.add_api_route(path, api.health, methods=["GET"])
    app.add_api_route("/live", api.live, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    return app


class HttpServer(uvicorn.Server):
    """uvicorn without signal handlers of its own: the gRPC ``serve`` owns SIGTERM/SIGINT and drains both."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


async def start_http(app: FastAPI, host: str, port: int) -> tuple[HttpServer, asyncio.Task]:
    """Serve ``app`` in a task; returns once it listens. Stop it with ``server.should_exit = True; await task``."""
    server = HttpServer(uvicorn.Config(app, host, port, log_level="warning", log_config=None, lifespan="off",
                                       access_log=False, timeout_graceful_shutdown=5))  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}") from task.exception()
        await asyncio.sleep(0.02)
    return server, task
