"""The balancer's core, without transport of its own: the public Generation API's logic in front of scheduler replicas.

It tokenizes (text, token ids, or chat messages through the DeepSeek-V4 chat encoding), validates,
picks a replica (by the prefix its cache holds, the session, the load: docs/routing.md), streams the replica's
tokens back as text deltas (incremental detokenization: never a partial UTF-8 character; text that could still
become a stop string is held back), applies stop strings (cancelling the replica's stream, which
frees the request's pages), and ends with the finish reason and usage.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from deepinfer import envs
from deepinfer.chat.turns import turn_boundaries
from deepinfer.engine.determinism import merge as merge_determinism
from deepinfer.rpc.convert import determinism_from_proto, determinism_to_proto
from deepinfer.serving.errors import ModelNotFound, Unavailable
from deepinfer.serving.metrics import METRICS, Metrics, finish_reason_name, status_label
from deepinfer.serving.tracing import inject_metadata, request_attributes, tracer
from deepinfer.telemetry import get_logger
from deepinfer.v1 import common_pb2, generation_pb2, scheduler_pb2
from services.balancer.admission import AdmissionGate, check_prompt, check_request
from services.balancer.cache_index import CacheIndex
from services.balancer.constraints import NOT_SERVED, ConstraintCompiler
from services.balancer.prompt import build_prompt, check_images, prompt_images
from services.balancer.rebalance import Rebalancer
from services.balancer.relay import Relay
from services.balancer.replicas import Replica, ReplicaSet, RouteHint

log = get_logger(__name__)
_tracer = tracer(__name__)
# a replica's stream that ends with these moves to another replica (a dead or draining replica's codes); any other
# ends the request with it: e.g. INTERNAL ``constraint.grammar: ...`` (the worker could not enforce the grammar)
MOVABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED})


@dataclass
class Hop:
    """What one submission of a request to a replica is: the prefill half of a disaggregated request (``hand_off``),
    its decode half (``decodes``, from the state exported at ``resume_position``), or a whole request."""

    hand_off: bool = False
    resume_position: int = 0
    decodes: bool = False


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Balancer:
    """The balancer without its front ends: admission, routing, the relay of each request from a replica (and its
    move to another one when that replica fails), the replicas' loads and facts. The gRPC servicer
    (:mod:`.servicer`) and the OpenAI HTTP app (:mod:`.http`) are adapters over it."""

    def __init__(
        self,
        tokenizer: object,
        info: generation_pb2.ModelInfo,
        replicas: list[str],
        metrics: Metrics | None = None,
        constraints: ConstraintCompiler | None = None,
        image_token_id: int | None = None,
    ) -> None:
        self.tokenizer, self.info, self.constraints = tokenizer, info, constraints
        # images (a model with image input): the placeholder token an image stands on in a prompt; None: no images
        self.image_token_id = image_token_id
        self.image_placeholder = None if image_token_id is None else tokenizer.id_to_token(image_token_id)
        self.metrics = metrics if metrics is not None else METRICS
        self.pool = ReplicaSet(replicas)
        self.pool.on_probed.append(self._count_roles)
        # the replicas' resume points (fed from NATS by discovery): cache-aware routing
        self.cache = CacheIndex(on_change=lambda a, n: self.metrics.cache_index.labels(info.model, a).set(n))
        self.gate = AdmissionGate(lambda: self.pool.replicas)  # refuses at once while every replica is full
        self._where: dict[str, Replica] = {}
        self._live: dict[str, tuple[Relay, str, int]] = {}  # request -> its relay, the replica's id, max_tokens
        self.rebalancer = Rebalancer(lambda: self.pool.replicas, self._live_requests,
                                     lambda n: self.metrics.rebalanced.labels(info.model).inc(n))  # fmt: skip
        self.samples: dict[str, int] = {}  # gRPC requests with n > 1 now running: id -> n (samples {id}-{i})
        self.draining = False  # SIGTERM: new requests are refused (UNAVAILABLE / 503), open ones finish
        self.in_flight = 0  # open streams of generate(), gRPC and HTTP alike (the drain waits for them)

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    def set_replicas(self, addresses: list[str]) -> None:
        """Route to exactly these scheduler replicas (kept ones keep their channel and counters)."""
        self.pool.set(addresses)

    def _count_roles(self) -> None:
        for role in ("mixed", "prefill", "decode", None):
            n = sum(1 for r in self.pool.routable() if r.role == role)
            self.metrics.replicas.labels(self.info.model, role or "unknown").set(n)

    def _live_requests(self) -> dict[str, tuple[Replica, str, int, int]]:
        """The requests in flight (``rebalance.Rebalancer``): replica, its request id, tokens left, tokens sent."""
        out = {}
        for rid, (relay, sid, max_tokens) in self._live.items():
            replica = self._where.get(rid)
            if replica is not None:
                sent = len(relay.generated)
                out[rid] = (replica, sid, max_tokens - sent, sent)
        return out

    def ready(self) -> bool:
        """Whether a request could be served now: not draining, and some replica is routable."""
        return not self.draining and bool(self.pool.routable())

    # -- helpers -------------------------------------------------------------------------------
    def prompt(
        self, which: str | None, req: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest
    ) -> tuple[list[int], str | None, list[dict] | None]:
        """Prompt ids, prompt text and (chat) the tools it renders."""
        return build_prompt(self.tokenizer, which, req, self.image_placeholder)

    async def _constraint(
        self, request: generation_pb2.GenerateRequest, ids: list[int], params: object, tools: list[dict] | None
    ) -> common_pb2.Constraint | None:
        if self.constraints is not None:
            return await self.constraints.build(request, ids, params, tools)
        if params.so_args is not None:
            raise ValueError(NOT_SERVED.format(where="so_args"))
        return None

    # -- RPCs ----------------------------------------------------------------------------------
    def replica_of(self, request_id: str) -> str | None:
        """The address of the replica that runs ``request_id`` now (None: not running)."""
        replica = self._where.get(request_id)
        return replica.address if replica is not None else None

    async def generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None, parent: Context | None = None,
        prefer: str | None = None, shared: bool = False,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:  # fmt: skip
        """The response stream of one request: shared by the gRPC and the HTTP front ends. ``prefer``: the address
        of the replica to send it to while that one is routable; ``shared``: other requests for the same prompt
        follow (the samples of an ``n`` > 1 request), so the replica keeps a prefix-cache resume point one token
        short of the prompt's end, where they resume (a prompt never resumes at its own end).

        Raises ValueError (naming the field) before anything is sent for a bad request, and the
        replica's ``grpc.aio.AioRpcError`` (RESOURCE_EXHAUSTED, UNAVAILABLE, ...) as it comes. The request
        is traced as one SERVER span (a child of ``parent``, if given) whose context goes to the replica."""
        if self.draining:
            raise _unavailable("the balancer is draining (shutting down): retry on another instance")
        op = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
        model = request.model or self.info.model
        span = _tracer.start_span(
            f"{op} {model}", context=parent, kind=trace.SpanKind.SERVER,
            attributes=request_attributes(op, model, request.sampling),
        )  # fmt: skip
        stream = self._generate(request, timeout, span, (prefer, shared))
        self.in_flight += 1
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
            self.in_flight -= 1
            await stream.aclose()  # the inner stream's cleanup (cancel the replica's call) runs now
            span.end()

    async def _generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None, span: trace.Span,
        route: tuple[str | None, bool] = (None, False),
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:  # fmt: skip
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        if request.model and request.model != self.info.model:
            raise ModelNotFound(f"model: {request.model!r} is not served here (serving {self.info.model!r})")
        check_request(request)  # field checks that need no tokenization; then tokenize off the event loop
        ids, _, tools = await asyncio.to_thread(self.prompt, request.WhichOneof("input"), request)
        images = prompt_images(request.WhichOneof("input"), request)
        check_images(ids, images, self.image_token_id, request.sampling)
        params = check_prompt(request, ids, self.info.max_model_len, self.info.vocab_size)  # fills in max_tokens
        try:
            with trace.use_span(span, end_on_exit=False):  # the grammar service's compile span is a child
                constraint = await self._constraint(request, ids, params, tools)
        except Unavailable as e:
            raise _unavailable(str(e)) from e
        # a chat's turn ends (positions right after each <｜Assistant｜>): the replica keeps resume points there, where
        # the conversation's next turn resumes (chat/turns.py)
        hints = turn_boundaries(ids, self.tokenizer) if request.WhichOneof("input") == "chat" else []
        hint = RouteHint(len(ids), session=request.session_id)
        if not images:  # (an image request's cache keys fold in the images' digests: its replica knows them)
            salt = request.cache_salt if request.HasField("cache_salt") else None
            routable = [r.address for r in self.pool.routable()]
            hint.cached = await asyncio.to_thread(self.cache.cached, routable, ids, salt)
        route = (*route, hint)
        async for out in self._relay(rid, (ids, images, hints), request, params, constraint, timeout, span, route):
            yield out

    async def _relay(
        self, rid: str, prompt: tuple[list[int], list[bytes], list[int]], request: generation_pb2.GenerateRequest,
        params: object, constraint: common_pb2.Constraint | None, timeout: float | None, span: trace.Span,
        route: tuple[str | None, bool, RouteHint | None] = (None, False, None),
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:  # fmt: skip
        """Stream the request from a replica (``route``: the preferred replica, whether samples share the prompt,
        what cache-aware routing knows: ``ReplicaSet.pick``); when that replica fails mid-stream, move the request
        (its prompt and the tokens sent so far) to a replica that serves — waiting for one up to
        ``DEEPINFER_MIGRATION_WAIT_S`` — at most ``DEEPINFER_MIGRATION_LIMIT`` times, so the caller sees one
        uninterrupted stream."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        relay = Relay(rid, prompt[0], params, self.tokenizer, prompt[1])
        relay.hints = prompt[2]
        metadata = inject_metadata(trace.set_span_in_context(span))
        (prefer, shared, hint), attempt, moves = route, 0, 0
        hint = hint if hint is not None else RouteHint()
        # disaggregation: the prompt on a prefill replica, the rest on a decode replica (docs/routing.md)
        split = prefer is None and not shared and not relay.images and params.prompt_logprobs is None
        hop = Hop(hand_off=split and self.pool.disaggregated())
        replica = self._route(self.pool.pick, prefer, hint, "prefill" if hop.hand_off else None)
        self.metrics.routes.labels(self.info.model, hint.reason).inc()
        while True:
            left = None if deadline is None else deadline - loop.time()
            replica.in_flight += 1
            self._where[rid] = replica
            submit = relay.submit(request, constraint, attempt, shared, hop.hand_off, hop.resume_position)
            self._live[rid] = (relay, submit.request_id, request.sampling.max_tokens)
            call = replica.submit(submit, left, metadata)
            error, handoff = None, None
            try:
                async for ev in call:
                    if ev.HasField("handoff"):  # its first token is out: the rest goes to a decode replica
                        handoff = ev.handoff.position
                        if relay.prefill_cached is None:  # (the prefill's, not a later handoff's)
                            relay.prefill_cached = (ev.cached_tokens, ev.cached_tier)
                        ev.ClearField("handoff")
                    out = relay.response(ev) if handoff is None or ev.token_ids else None
                    if out is not None:
                        if out.HasField("finished"):
                            self._count_end(hop, attempt, ev)
                        yield out
                        if out.HasField("finished"):
                            return
                    if handoff is not None:
                        break
                else:
                    error = _unavailable(f"replica {replica.address} ended the stream without finishing")
            except grpc.aio.AioRpcError as e:
                error = e
            finally:
                call.cancel()  # stop string or caller gone: the replica frees the request's pages
                replica.in_flight -= 1
                self._where.pop(rid, None)
                self._live.pop(rid, None)
            attempt += 1
            if error is None:  # handed off (first token out, replica draining, rebalancing): on from the exported state
                hop = Hop(resume_position=handoff, decodes=True)
                target = self.rebalancer.arrived(rid)  # where rebalancing moves it, if it does
                if target is not None and target.healthy:
                    replica = target
                    continue
                replica = await self._move(relay, deadline, "decode" if self.pool.routable("decode") else None)
                continue
            self.rebalancer.forget(rid)
            if error.code() not in MOVABLE or moves >= envs.DEEPINFER_MIGRATION_LIMIT:
                raise error
            moves += 1
            self.pool.failed(replica, f"{error.code().name}: {error.details()}")
            log.warning("request_moving", request_id=rid, replica=replica.address, attempt=moves,
                        sent_tokens=len(relay.generated), error=error.code().name)  # fmt: skip
            again = split and not relay.generated and self.pool.disaggregated()  # prefill again, elsewhere
            hop = Hop(hand_off=True) if again else Hop(resume_position=hop.resume_position, decodes=hop.decodes)
            replica = await self._move(relay, deadline, "prefill" if hop.hand_off else None)

    def _count_end(self, hop: Hop, attempt: int, ev: scheduler_pb2.TokenEvent) -> None:
        """Count how a request that changed replicas got its state there: a handoff, or a move after a failure."""
        if hop.decodes:
            self.metrics.handoffs.labels(self.info.model, ev.cached_tier or "recompute").inc()
        elif attempt:
            self.metrics.migrations.labels(self.info.model, ev.cached_tier or "recompute").inc()

    async def _move(self, relay: Relay, deadline: float | None, role: str | None) -> Replica:
        """The replica a request moves to after its replica failed. One that has sent nothing yet goes where it can
        be served now, like a new one; one that has streamed tokens waits for a replica (the restarted one, with one
        replica) up to ``DEEPINFER_MIGRATION_WAIT_S``."""
        loop = asyncio.get_running_loop()
        wait = envs.DEEPINFER_MIGRATION_WAIT_S if relay.started else 0.0
        wait = wait if deadline is None else min(wait, deadline - loop.time())
        return self._route(self.pool.pick, None, None, role) if wait <= 0 else await self._wait_route(wait)

    def _route(self, pick: Callable[..., Replica], *args: object) -> Replica:
        try:
            return pick(*args)
        except Unavailable as e:
            raise _unavailable(str(e)) from e

    async def _wait_route(self, wait_s: float) -> Replica:
        try:
            return await self.pool.wait_pick(wait_s)
        except Unavailable as e:
            raise _unavailable(f"{e} (waited {wait_s:.0f} s to move the request)") from e

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort these requests on the replicas that run them; the ids that were aborted."""
        aborted = []
        for rid in request_ids:
            n = self.samples.get(rid)
            for sub in [rid] if n is None else [f"{rid}-{i}" for i in range(n)]:  # an n > 1 request: its samples
                replica = self._where.get(sub)
                if replica is not None:
                    res = await replica.stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_ids=[sub]), timeout=10)
                    if res.aborted and (n is None or rid not in aborted):
                        aborted.append(rid)
        return aborted

    async def model_info(self) -> generation_pb2.ModelInfo:
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

    async def loads(self) -> generation_pb2.GetLoadsResponse:
        """Each replica's load as it reports it; one out of routing (or unreachable) says draining."""
        out = generation_pb2.GetLoadsResponse()
        for r in self.replicas:
            try:
                load = await r.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                load = common_pb2.ReplicaLoad(draining=True)
            load.draining = load.draining or not r.healthy  # out of routing, whatever it says of itself
            load.replica_id = r.address
            out.replicas.append(load)
        return out
