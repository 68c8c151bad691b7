"""The worker service: the ``deepinfer.v1.Worker`` servicer over the worker runtime (:class:`ModelRunner`).

One ``Step`` stream per scheduler. Steps run in arrival order; a chunk token ``-1`` stands for the
token the same request sampled in its previous step, which never leaves the worker before it is
needed (the scheduler's async pipeline sends step N+1 before step N's result arrives, and the worker
launches step N+1 before it collects step N's tokens). When the stream ends, the state of every
request it carried is dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from deepinfer import envs
from deepinfer.engine.factory import EngineParts, build_worker
from deepinfer.engine.heap import freeze_heap, thaw_heap
from deepinfer.engine.image_cache import FeatureBudget, FeatureCache
from deepinfer.engine.multimodal import MultiModalInput, prepare_images
from deepinfer.events import EventBus, Registration
from deepinfer.events.experts import ExpertLoadReporter
from deepinfer.image_inputs import MAX_IMAGE_BYTES
from deepinfer.parallel.launch import RankedWorker, RanksLost, start_worker
from deepinfer.parallel.layout import add_arguments as add_layout_arguments
from deepinfer.parallel.layout import from_args as layout_from_args
from deepinfer.rpc.convert import determinism_to_proto, plan_from_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving import grammar_view
from deepinfer.serving.collectors import CurrentBalancer, ExpertBalanceCollector
from deepinfer.serving.errors import Overloaded
from deepinfer.serving.metrics import WorkerMetrics, start_metrics_server
from deepinfer.serving.presence import Presence, advertised, instance_id
from deepinfer.serving.server import Service, serve, status_for, tune_interpreter
from deepinfer.serving.step_pipeline import StepPipeline
from deepinfer.serving.step_profiler import StepProfiler
from deepinfer.serving.tracing import StepTraces, tracer
from deepinfer.telemetry import configure_logging, configure_tracing, get_logger
from deepinfer.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)
T = TypeVar("T")
_tracer = tracer(__name__)


MAX_IN_FLIGHT = 3  # launched steps whose results are not collected yet (DEEPINFER_SCHEDULER_STEPS_IN_FLIGHT's most)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """``world`` > 1: a worker of several ranks (``parts.runner`` a ``parallel.rank_group.RankGroupRunner``), which
    takes plans of ``world`` ranks' steps (``StepPlan.ranks``)."""

    def __init__(
        self, parts: EngineParts, worker_id: str, metrics: WorkerMetrics | None = None, world: int = 1,
        processes: int | None = None, ranked: RankedWorker | None = None,
    ) -> None:  # fmt: skip
        self.parts: EngineParts | None = parts  # None while a worker of several ranks loads another model
        self.worker_id, self.world = worker_id, world
        self.processes = world if processes is None else processes  # its ranks' processes (tensor parallel: more)
        self.ranked = ranked  # a worker of several ranks: how to start its ranks again (LoadModel)
        self._loading = False  # a model load runs: no Step stream opens
        self.metrics = metrics if metrics is not None else WorkerMetrics(str(parts.path))
        self._lock = asyncio.Lock()  # one image preparation or model load at a time
        self._device = threading.Lock()  # the runner runs one thing at a time: a step's launch or collection, ...
        self._streams = 0  # open Step streams (a model is only replaced while there are none)
        self.images: dict[str, MultiModalInput] = {}  # prepared images by request id (PrepareImages)
        self._encoder: FeatureCache | None = None  # the model's image encoder behind a cache, made on the first image
        self.budget = FeatureBudget(envs.DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES)  # the features requests hold here
        self.profiler = StepProfiler(envs.DEEPINFER_TORCH_PROFILER_DIR, envs.DEEPINFER_PROFILE_SKIP_STEPS,
                                     envs.DEEPINFER_PROFILE_STEPS, worker_id, parts.runner.device)  # fmt: skip

    async def PrepareImages(  # noqa: N802
        self, request: worker_pb2.PrepareImagesRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareImagesResponse:
        """Encode a request's images (those in the feature cache are not encoded again) and expand its placeholders;
        the features stay here for its chunks, counted against the worker's budget until the request ends."""
        p, rid = self.parts, request.request_id
        try:
            if not rid:
                raise ValueError("request_id: required")
            if any(len(b) > MAX_IMAGE_BYTES for b in request.images):
                raise ValueError(f"images: an image is larger than {MAX_IMAGE_BYTES} bytes")
            if self.processes > self.world:  # (rank 0 alone holds the features; its group's other ranks need them)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "images: not served by a worker of "
                                    "tensor- or context-parallel groups (--tp, --cp)")  # fmt: skip
            async with self._lock:  # one preparation at a time; the encoder runs between steps (the device lock)
                p = self.parts  # (another model may have been loaded meanwhile)
                if p is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker has no model: it is restarting")
                self.budget.check_room()
                if self._encoder is None:
                    cache_bytes = envs.DEEPINFER_IMAGE_FEATURE_CACHE_BYTES
                    self._encoder = FeatureCache(p.family.image_encoder(p.model), cache_bytes)
                enc, before = self._encoder, (self._encoder.encoded, self._encoder.hits)
                try:
                    ids, mm = await asyncio.to_thread(
                        self._on_device, prepare_images, p.family, p.config, enc, list(request.token_ids),
                        list(request.images),
                    )  # fmt: skip
                finally:
                    self.metrics.images(enc.encoded - before[0], enc.hits - before[1], enc.bytes, self.budget.total)
                self.budget.take(rid, mm.data)
                self.metrics.images(0, 0, enc.bytes, self.budget.total)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.images[rid] = mm
        spans = [x for span in mm.spans for x in span]
        return worker_pb2.PrepareImagesResponse(token_ids=ids, spans=spans, digests=list(mm.digests))

    async def Step(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.StepPlan], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepResult]:
        """Steps in order, pipelined (``serving.step_pipeline``): a plan that arrives while the previous step runs on
        the device is launched before that step's result is collected, so the device never waits for the host's work
        between steps (placeholders read the previous step's samples on the device: ``ModelRunner.launch``)."""
        if self._loading or self.parts is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is loading a model: try again")
        known: dict[str, SamplingParams] = {}
        traces = StepTraces(_tracer)  # each request's trace: linked from the steps that serve it, and their parent
        pipeline = StepPipeline(self.parts.runner, self._device, self.metrics, traces, MAX_IN_FLIGHT, self.profiler)
        reader = asyncio.create_task(self._read(request_iterator, known, pipeline))
        error: Exception | None = None
        self._streams += 1
        try:
            async for out in pipeline.results():
                yield out
        except Exception as e:  # noqa: BLE001 - mapped to a status below, never a traceback on the wire
            error = e
        finally:
            reader.cancel()
            await pipeline.close()  # the steps launched are collected: the runner is free
            self._streams -= 1
            with self._device:
                self.parts.runner.release(list(known))
            for rid in known:
                self._drop_images(rid)
        if error is not None:
            code, text = status_for(error)
            if code == grpc.StatusCode.INTERNAL:
                log.error("step_failed", exc_info=error)
            broken = getattr(self.parts.runner, "broken", None)
            if broken is not None:  # its ranks are out of step: the worker ends, its supervisor starts it afresh
                log.error("rank_group_broken", reason=broken)
                os.kill(os.getpid(), signal.SIGTERM)
            await context.abort(code, text)

    async def _read(
        self, request_iterator: AsyncIterator[worker_pb2.StepPlan], known: dict, pipeline: StepPipeline
    ) -> None:
        """Convert a stream's plans and hand them to ``pipeline``; its end or a bad plan ends the stream there."""
        try:
            async for msg in request_iterator:
                if len(msg.ranks) != (self.world if self.world > 1 else 0):
                    raise ValueError(f"ranks: the plan has {len(msg.ranks)} ranks' steps; this worker has "
                                     f"{self.world} rank(s) (WorkerInfo.world_size)")  # fmt: skip
                plan = plan_from_proto(msg, known, self.images)
                for rid in msg.dropped_images:  # the plan's chunks hold what they need
                    self._drop_images(rid)
                pipeline.submit(plan)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bad plan or a broken stream: the steps already launched report
            pipeline.submit(e)
            return
        pipeline.submit(None)

    def _on_device(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` while no step launches or is collected (in a worker thread)."""
        with self._device:
            return fn(*args)

    def _drop_images(self, request_id: str) -> None:
        """The request is over: its features leave the worker and its budget."""
        if self.images.pop(request_id, None) is not None:
            self.budget.release(request_id)
            self.metrics.image_held_bytes.labels(self.metrics.model).set(self.budget.total)

    async def LoadModel(  # noqa: N802
        self, request: worker_pb2.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        """Load another model in place of the current one (weights and a fresh KV cache); a worker of several ranks
        starts its ranks afresh with it (``parallel.launch.RankedWorker``)."""
        from deepinfer.checkpoint.hub import ModelUnavailable

        if not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model: required")
        if self.processes > 1 and self.ranked is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"a worker of {self.processes} ranks started without its ranks' launcher")  # fmt: skip
        build = dict(model=request.model, dtype=request.dtype or "auto", max_model_len=request.max_model_len or None,
                     num_pages=request.num_pages or None, page_size=request.page_size or None)  # fmt: skip
        async with self._lock:
            if self._streams:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self._streams} step stream(s) open: drain the scheduler first",
                )
            self._loading, frozen = True, envs.DEEPINFER_GC_FREEZE
            if frozen:
                thaw_heap()  # the replaced model's reference cycles must be collectible (engine/heap.py)
            try:
                failed = await asyncio.to_thread(self._on_device, self._load, build)
                if failed is not None:  # (a worker of several ranks: it runs the model it ran before)
                    raise failed if isinstance(failed, (ValueError, ModelUnavailable)) else ValueError(repr(failed))
            except (ValueError, ModelUnavailable) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: {e}")
            except RanksLost as e:  # nothing to serve with: the worker ends, its supervisor starts it afresh
                log.error("worker_lost", reason=str(e))
                os.kill(os.getpid(), signal.SIGTERM)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            finally:
                self._loading = False
                if frozen:  # collects the replaced model, then freezes the new one's start-up objects
                    log.info("heap_frozen", **freeze_heap())
        log.info("model_replaced", model=str(self.parts.path))
        return await self.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), context)

    def _load(self, build: dict[str, Any]) -> Exception | None:
        """(In a worker thread, the runner's lock held.) The model of ``build`` in place of the current one; a worker
        of several ranks gives back the failure of a model its ranks could not load (they run the old one again)."""
        if self.ranked is None:  # the new model loads beside the old one, which stays where the new one fails
            self.parts, failed = build_worker(accelerator=self.parts.accelerator, **build), None
        else:
            self._encoder = None  # (it holds rank 0's model)
            self.parts, failed = self.ranked.reload(self._take_runner, build)
        if failed is None:  # the prepared images' features are the old model's
            self._encoder, self.images = None, {}
            self.budget.clear()
        return failed

    def _take_runner(self) -> Any:
        """The runner, this service's last hold on the model dropped (``RankedWorker.reload``)."""
        parts, self.parts = self.parts, None
        return parts.runner

    async def GetWorkerInfo(  # noqa: N802
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        p = self.parts
        if p is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is loading a model: try again")
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            accelerator=p.accelerator,
            device=str(p.runner.device),
            model=str(p.path),
            num_pages=p.num_pages,
            page_size=p.page_size,
            max_model_len=p.max_model_len,
            vocab_size=p.config.vocab_size,
            eos_token_id=p.config.eos_token_id,
            dtype=str(p.dtype).removeprefix("torch."),
            rank=0,
            world_size=self.world,
            determinism=determinism_to_proto(p.determinism),
            fingerprint=p.fingerprint,
            kvstore=p.runner.remote is not None,
            num_speculative_tokens=p.runner.spec.max_drafts if p.runner.spec is not None else 0,
        )


def build_parser() -> argparse.ArgumentParser:
    """Flags of the worker services."""
    p = argparse.ArgumentParser(description="deepinfer worker: runs steps on one accelerator")
    p.add_argument("--model", help="model directory or hub id (default: DEEPINFER_HF_MODEL_DIR / DEEPINFER_MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--accelerator", choices=["nvidia", "ascend", "cpu"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-pages", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    add_layout_arguments(
        p,
        "ranks of the worker, one device each, the MoE experts shared among them "
        "(default: DEEPINFER_EP; docs/parallelism.md)",
    )
    p.add_argument("--unix-socket", type=Path, help="also serve on this Unix socket, for a scheduler on this host "
                   "(default: DEEPINFER_WORKER_UNIX_SOCKET)")  # fmt: skip
    return p


def main(default_accelerator: str, argv: list[str] | None = None) -> int:
    """Entry point of the worker services (``python -m services.worker_nvidia`` / ``worker_ascend``).

    ``DEEPINFER_ACCELERATOR`` (or ``--accelerator``) overrides the service's own backend, so
    ``DEEPINFER_ACCELERATOR=cpu python -m services.worker_nvidia`` serves with the reference ops."""
    args = build_parser().parse_args(argv)
    # steps run in a thread beside the event loop that reads the next plan; with the default 5 ms GIL switch
    # interval the loop waits up to 5 ms per wake-up while a step computes
    tune_interpreter()
    configure_logging()
    try:  # a missing extra (MissingExtra) or a model that cannot load: one line, status 2
        provider = configure_tracing("deepinfer-worker")
        env_acc = envs.DEEPINFER_ACCELERATOR if envs.is_set("DEEPINFER_ACCELERATOR") else None
        accelerator = args.accelerator or env_acc or default_accelerator
        layout = layout_from_args(args)
        build = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_pages=args.num_pages,
                     page_size=args.page_size)  # fmt: skip
        ahead = grammar_view.start_ahead(args.model)  # the tokenizer's grammar view, built while the model loads
        parts, procs = start_worker(layout, accelerator, **build)
    except (RuntimeError, ValueError) as e:
        print(f"deepinfer worker: cannot start: {e}", flush=True)
        return 2
    if parts.runner.constraints is not None:  # ready before the worker serves: no step waits for it
        grammar_view.ready(parts.runner.constraints, ahead)
    if envs.DEEPINFER_GC_FREEZE:  # the start-up's objects out of every later full collection (engine/heap.py)
        log.info("heap_frozen", **freeze_heap())
    worker_id = instance_id("worker")
    ranked = None if procs is None else RankedWorker(layout, accelerator, build, procs)
    servicer = WorkerService(parts, worker_id, WorkerMetrics(str(parts.path)), layout.dp, layout.ranks, ranked)
    service = Service("deepinfer.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server)
    registration = Registration(
        worker_id,
        "worker",
        advertised(args.host, args.port),
        model=str(parts.path),
        capacity={"num_pages": parts.num_pages, "page_size": parts.page_size, "accelerator": parts.accelerator,
                  "ranks": layout.ranks, "tp": layout.tp, "cp": layout.cp},
    )  # fmt: skip
    presence = Presence(registration)
    if getattr(parts.runner, "balancer", None) is not None:  # each rank's expert loads on NATS, EPLB in the metrics
        balancer = CurrentBalancer(servicer)  # (the running model's: LoadModel makes another)
        presence.on_connected.append(functools.partial(_expert_reports, balancer, worker_id))
        servicer.metrics.registry.register(ExpertBalanceCollector(balancer, servicer.metrics.model))
    stop_metrics = None
    if args.metrics_port > 0:
        stop_metrics = start_metrics_server(servicer.metrics.registry, args.host, args.metrics_port)
    del parts  # the servicer's hold on the model is the only one (LoadModel frees it)
    try:
        unix = args.unix_socket or envs.DEEPINFER_WORKER_UNIX_SOCKET
        asyncio.run(_serve_with_presence([service], args.host, args.port, presence, unix))
    finally:
        if ranked is not None and servicer.parts is not None:
            ranked.procs.close(servicer.parts.runner)
        if stop_metrics is not None:
            stop_metrics()
        provider.shutdown()  # flushes the spans still batched
    return 0


async def _expert_reports(balancer: CurrentBalancer, replica: str, bus: EventBus) -> None:
    """Publish each rank's expert loads (``ExpertBalancer.take``) on NATS until the process ends."""
    for r in range(balancer.world):
        supplier = functools.partial(balancer.take, r)
        await ExpertLoadReporter(bus, replica, r, supplier, period_s=envs.DEEPINFER_EXPERT_LOAD_REPORT_PERIOD_S).start()


async def _serve_with_presence(
    services: list[Service], host: str, port: int, presence: Presence, unix_socket: Path | None = None
) -> None:
    async def started(_: object) -> None:
        await presence.start()

    try:
        await serve(services, host, port, on_started=started, unix_socket=unix_socket)
    finally:
        await presence.close()
