"""Services on NATS: registration, discovery by the balancer, and a data plane that outlives NATS."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.events import EventBus, NatsServer, RegistryView
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)


async def registered(url: str, want: set[str], timeout: float = 20.0) -> set[str]:
    bus = EventBus("test-view")
    await bus.connect(url)
    view = RegistryView(bus, resync_s=1.0)
    await view.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            kinds = {r.kind for r in view.instances()}
            if want <= kinds or time.monotonic() > deadline:
                return kinds
            await asyncio.sleep(0.2)
    finally:
        await view.close()
        await bus.close()


async def generate(address: str, n: int, tag: int) -> list[tuple[int, int]]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(i: int) -> tuple[int, int]:
            req = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[0, tag, 300 + i]),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6),
            )
            msgs = [m async for m in stub.Generate(req, timeout=60)]
            return msgs[-1].finished.reason, sum(len(m.token_ids) for m in msgs)

        return await asyncio.gather(*[one(i) for i in range(n)])


def test_balancer_discovers_schedulers_and_survives_a_nats_outage(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", seed=2)
    nats = NatsServer().start()
    # each service with its own kind's credentials; registry entries of a 2 s TTL (the outage below outlasts four)
    mesh = Mesh(model, tmp_path, nats=nats, discover=True, extra_env={"DEEPINFER_PRESENCE_TTL_S": "2"})
    try:
        mesh.up(http=False)
        kinds = asyncio.run(registered(nats.url, {"worker", "scheduler"}))
        assert {"worker", "scheduler"} <= kinds
        # the balancer has no --scheduler: it routes to what the registry lists
        deadline = time.monotonic() + 20
        while True:
            try:
                ok = asyncio.run(generate(mesh.address("balancer"), 4, 11))
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.3)
        assert ok == [(common_pb2.FINISH_REASON_LENGTH, 6)] * 4
        # NATS goes away for 8 s (four registry TTLs, a failed resync of the balancer's view every 5 s): generation
        # goes on with the last known registry, 0 failed
        nats.stop()
        down_at, k = time.monotonic(), 0
        while time.monotonic() - down_at < 8:
            assert (
                asyncio.run(generate(mesh.address("balancer"), 4, 20 + k)) == [(common_pb2.FINISH_REASON_LENGTH, 6)] * 4
            )
            k += 1
            time.sleep(1)
        nats.start()  # same port and store: the services reconnect and register again by themselves
        assert {"worker", "scheduler"} <= asyncio.run(registered(nats.url, {"worker", "scheduler"}))
    finally:
        mesh.down()
        nats.close()
