"""``run_scheduler``: the scheduler service put together: the worker dialled and asked for its facts, the engine's
scheduler sized from them, the gRPC servicer, registration on NATS, the KV index, metrics, drain."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc

from deepinfer.engine.data_parallel import DataParallelScheduler
from deepinfer.engine.scheduler import Scheduler
from deepinfer.rpc.channel import Backoff
from deepinfer.serving.metrics import SchedulerMetrics
from deepinfer.telemetry import get_logger
from deepinfer.v1 import scheduler_pb2_grpc, worker_pb2
from services.scheduler.remote_worker import RemoteWorker
from services.scheduler.servicer import SchedulerService

log = get_logger(__name__)


async def _first_info(worker: RemoteWorker) -> worker_pb2.WorkerInfo:
    """The worker's info, waiting as long as it takes (a worker loads its weights for minutes)."""
    backoff = Backoff()
    while True:
        try:
            return await worker.info(timeout=30)
        except grpc.aio.AioRpcError as e:
            log.info("waiting_for_worker", address=worker.address, error=e.code().name)
            await backoff.wait()


def _service(worker: RemoteWorker, info: worker_pb2.WorkerInfo, role: str, max_queued: int) -> SchedulerService:
    """The scheduler sized from the worker's info (one per rank of a worker of several), in its service."""
    from deepinfer.engine.pages import PagePool
    from deepinfer.engine.scheduler_config import config_from_env

    config = config_from_env(
        info.page_size,
        info.max_model_len,
        info.eos_token_id,
        fingerprint=info.fingerprint,
        remote_store=info.kvstore,
        num_speculative_tokens=info.num_speculative_tokens,
    )
    if info.world_size > 1:  # a worker of several ranks: one scheduler per rank, each of num_pages pages
        scheduler = DataParallelScheduler(config, info.num_pages, info.world_size)
    else:
        scheduler = Scheduler(config, PagePool(info.num_pages))
    if role != "mixed" and scheduler.remote is None:  # the handoff's state moves through the kvstore
        raise SystemExit(f"scheduler --role {role}: the worker has no kvstore (DEEPINFER_KVSTORE_URL) or prefix cache")
    service = SchedulerService(scheduler, worker, info.vocab_size, max_queued, SchedulerMetrics(info.model))
    service.worker_info, service.role = info, role
    return service


async def run_scheduler(
    worker_address: str, host: str, port: int, max_queued: int, grace_s: float = 30.0, metrics_port: int = 0,
    role: str = "mixed",
) -> int:  # fmt: skip
    """Connect to the worker, size the scheduler from its info, serve ``deepinfer.v1.Scheduler`` (and, with
    ``metrics_port`` > 0, Prometheus metrics at ``http://host:metrics_port/metrics``). The exit code: 0 after a
    stop, 1 when the replica ended itself for a fault (its engine loop failed, its worker came back as another
    model): its supervisor starts a fresh one either way, and the code says which it was."""
    from deepinfer.events import Registration
    from deepinfer.serving.metrics import start_metrics_server
    from deepinfer.serving.presence import Presence, advertised, instance_id
    from deepinfer.serving.server import RunningServer, Service, serve

    worker = RemoteWorker(worker_address)
    info = await _first_info(worker)
    service = _service(worker, info, role, max_queued)
    scheduler, config, metrics = service.scheduler, service.scheduler.config, service.metrics
    stop_metrics = start_metrics_server(metrics.registry, host, metrics_port) if metrics_port > 0 else None
    tasks: list[asyncio.Task] = []
    registration = Registration(
        instance_id("scheduler"),
        "scheduler",
        advertised(host, port),
        role=role,
        model=info.model,
        capacity={"max_queued": max_queued, "num_pages": info.num_pages, "worker": worker_address},
    )
    presence = Presence(registration, load=service.load_report)

    faulted: list[bool] = []

    async def started(running: RunningServer) -> None:
        async def fatal() -> None:  # the process ends; its supervisor starts a fresh one
            faulted.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

        service.on_serving.append(running.set_serving)
        service.on_fatal.append(fatal)
        tasks.append(asyncio.create_task(service.run()))
        from services.scheduler.kv_index import DeviceKVPublisher, KVIndexFollower

        if scheduler.remote is not None:  # what every kvstore holds, from their KV events on NATS
            presence.on_connected.append(KVIndexFollower(scheduler, info.fingerprint).start)
        if config.prefix_caching:  # this replica's own resume points, published
            publisher = DeviceKVPublisher(
                registration.instance_id, info.fingerprint, registration.address, info.page_size
            )
            scheduler.kv_listeners.append(publisher.on_event)
            presence.on_connected.append(publisher.start)
        await presence.start()

    async def drain(grace: float) -> None:  # leave the registry first: no balancer routes here any more
        loop = asyncio.get_running_loop()
        start = loop.time()
        await presence.close()
        await service.drain(max(0.0, grace - (loop.time() - start)))  # within the grace serve() allows

    svc = Service("deepinfer.v1.Scheduler", service, scheduler_pb2_grpc.add_SchedulerServicer_to_server)
    try:
        await serve([svc], host, port, grace_s=grace_s, on_drain=drain, on_started=started)
    finally:
        await presence.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the engine loop is over before its channel closes
        await worker.close()
        if stop_metrics is not None:
            stop_metrics()
    return 1 if faulted else 0
