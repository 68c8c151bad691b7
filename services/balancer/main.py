"""``run_balancer``: the balancer service put together: its core, the gRPC API, the OpenAI HTTP API, discovery of
the replicas on NATS, readiness and drain."""

from __future__ import annotations

import asyncio

from deepinfer import envs
from deepinfer.serving.server import RunningServer
from deepinfer.v1 import generation_pb2, generation_pb2_grpc
from services.balancer.admission import served_model_name
from services.balancer.constraints import ConstraintCompiler
from services.balancer.core import Balancer
from services.balancer.servicer import PUBLIC, GenerationServicer


async def run_balancer(
    model: str | None,
    schedulers: list[str],
    host: str,
    port: int,
    max_model_len: int | None,
    http_port: int | None = None,
    served_name: str | None = None,
) -> None:
    """Serve ``deepinfer.v1.Generation`` for the model in ``model`` (tokenizer and config only) and, with
    ``http_port``, the OpenAI-compatible HTTP API beside it; both drain and stop together on SIGTERM. The APIs
    name the model ``served_name`` (default: the model directory's base name, or the hub id)."""
    from deepinfer.engine.model_dir import resolve_model_dir
    from deepinfer.grammar import tokenizer_fingerprint
    from deepinfer.serving.server import Service, serve
    from deepinfer.tokenizer import load_tokenizer

    path, config = resolve_model_dir(model)
    tokenizer = load_tokenizer(path)
    constraints = ConstraintCompiler(
        tokenizer, envs.DEEPINFER_GRAMMAR_URL, tokenizer_fingerprint(path), envs.DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S
    )
    info = generation_pb2.ModelInfo(
        model=served_model_name(model, path, served_name),
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len or config.max_position_embeddings,
        eos_token_id=config.eos_token_id,
        structured_output_types=constraints.kinds,
    )
    vision = getattr(config, "vision_config", None)  # DeepSeek-V4.1 with a vision tower takes images
    image_id = config.image_token_id if vision is not None and vision.num_hidden_layers > 0 else None
    service = Balancer(tokenizer, info, schedulers, constraints=constraints, image_token_id=image_id)
    servicer = GenerationServicer(service)
    services = [Service("deepinfer.v1.Generation", servicer, generation_pb2_grpc.add_GenerationServicer_to_server)]
    from services.balancer.discovery import Discovery

    discovery = Discovery(service, schedulers)
    app = None

    async def started(running: RunningServer) -> None:  # readiness follows the replicas; probes start
        service.pool.start()
        service.gate.start()  # the replicas' capacities, known before the first burst
        service.rebalancer.start()  # (DEEPINFER_REBALANCE_INTERVAL_S: 0, off)
        tasks.append(asyncio.create_task(_mirror_readiness(service, running)))

    async def drain(grace_s: float) -> None:  # 503 / UNAVAILABLE for new requests; open streams finish
        service.draining = True
        if app is not None:
            app.state.api.draining = True
        while service.in_flight or (app is not None and app.state.api.in_flight):
            await asyncio.sleep(0.05)

    tasks: list[asyncio.Task] = []
    grace = envs.DEEPINFER_DRAIN_GRACE_S
    try:
        await discovery.start()
        if http_port is None:
            await serve(services, host, port, grace_s=grace, on_drain=drain, on_started=started, public=PUBLIC)
            return

        from services.balancer.http import create_app, start_http

        app = create_app(service)
        http, task = await start_http(app, host, http_port)  # listening before gRPC reports SERVING
        try:
            await serve(services, host, port, grace_s=grace, on_drain=drain, on_started=started, public=PUBLIC)
        finally:
            http.should_exit = True
            await task
    finally:
        for t in tasks:
            t.cancel()
        await discovery.close()
        await service.gate.close()
        await service.rebalancer.close()
        await service.pool.close()
        await constraints.close()


async def _mirror_readiness(service: Balancer, running: RunningServer, period_s: float = 0.1) -> None:
    """gRPC health says SERVING exactly while a request could be served (a replica is routable, not draining)."""
    serving = None
    while not service.draining:
        now = service.ready()
        if now != serving:
            await running.set_serving(now)
            serving = now
        await asyncio.sleep(period_s)
