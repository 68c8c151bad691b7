"""The attacks of issue 34 (item 6) against the launcher's mesh — NATS, the kvstore, two replicas, the balancer:
everything said on NATS during prompts carries hashes, never the prompts' token ids, while a resume point offloaded
by one replica is still a kvstore hit on the other; a client without credentials cannot connect, and a client with
another kind's credentials cannot register a scheduler nor read or forge KV events."""

from __future__ import annotations

import asyncio
import random
import re
import struct
import time

import nats
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.events import EventBus, Registration, Registry, RegistryView
from deepinfer.events.bus import barrier
from deepinfer.rpc.channel import open_channel
from deepinfer.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from serving.launched import launched_mesh

pytestmark = pytest.mark.timeout(300)
VOCAB = 129280


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("kv_security")
    env = dict(DEEPINFER_PREFIX_CACHE_RESUME_POINTS="1", DEEPINFER_BATCH_INVARIANT="1",  # older points: kvstore
               DEEPINFER_INTERNAL_TOKEN="test-internal-token")  # for the mesh and this test  # fmt: skip
    with launched_mesh(tmp, make_tiny_model(tmp / "model", seed=8), **env) as m:
        yield m


async def submit(address: str, rid: str, ids: list[int]) -> tuple[list[int], int]:
    async with open_channel(address) as ch:
        req = scheduler_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        )  # fmt: skip
        tokens, cached = [], 0
        async for ev in scheduler_pb2_grpc.SchedulerStub(ch).Submit(req, timeout=60):
            tokens += list(ev.token_ids)
            cached = max(cached, ev.cached_tokens)
        return tokens, cached


def leaks(data: bytes, prompt: list[int]) -> bool:
    """Whether ``data`` holds two consecutive ids of ``prompt``: as decimal numbers in a row (JSON, CSV, ...), or
    as packed 32- or 64-bit integers."""
    pairs = set(zip(prompt, prompt[1:]))
    numbers = [int(n) for n in re.findall(rb"\d+", data)]
    if any(pair in pairs for pair in zip(numbers, numbers[1:])):
        return True
    return any(struct.pack(f"<2{w}", *pair) in data for pair in pairs for w in "iq")


def test_the_leak_detector_finds_the_old_event_format():
    prompt = list(range(1000, 1045))
    old = b'{"meta":{"position":"45","base":"ab12","tail":"' + ",".join(map(str, prompt[32:])).encode() + b'"}}'
    assert leaks(old, prompt) and leaks(struct.pack("<3q", *prompt[3:6]), prompt)
    assert not leaks(b'{"tag":"1032ab","anchor":"1040","position":45}', prompt)  # ids, but not in a row


def test_nats_traffic_carries_no_token_ids_and_kvstore_hits_still_happen(mesh) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(45)] for _ in range(2)]
    a, b = mesh.endpoints["scheduler-0"], mesh.endpoints["scheduler-1"]

    async def run() -> tuple[list[tuple[str, bytes]], list[int]]:
        seen: list[tuple[str, bytes]] = []
        nc = await nats.connect(mesh.nats.url)  # the mesh's own server, as admin: every subject

        async def on_msg(msg) -> None:
            seen.append((msg.subject, bytes(msg.data)))

        await nc.subscribe(">", cb=on_msg)
        await barrier(nc)  # the server has the subscription before the mesh publishes
        hits = []
        for i, prompt in enumerate(prompts):
            await submit(a, f"a{i}", prompt)  # its prompt-end resume point moves to the kvstore
            deadline, n = time.monotonic() + 30, 0
            while True:  # replica 1 learns of it from the kvstore's KV events, then resumes from it
                n += 1
                _, cached = await submit(b, f"b{i}-{n}", prompt + [rng.randrange(2, VOCAB) for _ in range(6)])
                if cached or time.monotonic() > deadline:
                    hits.append(cached)
                    break
                await asyncio.sleep(0.2)
        await asyncio.sleep(0.3)  # the last batches of events
        await nc.close()
        return seen, hits

    seen, hits = asyncio.run(run())
    assert hits == [45, 45]
    kv_events = [m for s, m in seen if s.startswith("deepinfer.kv.")]
    assert any(b'"tier":"host"' in m and b'"tag"' in m for m in kv_events)
    for subject, data in seen:
        for prompt in prompts:
            assert not leaks(data, prompt), (subject, data[:300])
    # no service needed anything its permissions do not allow
    assert "Violation" not in mesh.nats.log_tail(100_000)


def test_other_credentials_cannot_register_a_scheduler_or_read_kv_events(mesh) -> None:
    async def run() -> None:
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(mesh.nats.address, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
        balancer = EventBus("attacker")
        await balancer.connect(mesh.nats.url_for("balancer"))
        fake = Registration("fake", "scheduler", "127.0.0.1:1")
        assert not await Registry(balancer, fake, ttl_s=5).refresh()  # refused: never acknowledged
        view = RegistryView(balancer)  # what the balancer's discovery sees
        await view.start()
        deadline = time.monotonic() + 30  # its first read may time out on a loaded machine: it reads again
        while len(view.instances("scheduler")) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            await view.resync()
        live = {r.instance_id for r in view.instances("scheduler")}
        assert len(live) == 2 and "fake" not in live
        await view.close()
        await balancer.close()
        worker = EventBus("attacker-2")
        await worker.connect(mesh.nats.url_for("worker"))
        got: list[dict] = []

        async def on_kv(subject, payload):
            got.append(payload)

        await worker.subscribe("deepinfer.kv.>", on_kv)  # refused by the server
        await worker.publish("deepinfer.kv.kvstore.forged", {"events": []})  # refused too
        await barrier(worker.nc)  # the server has answered the subscription and the publish
        await worker.close()
        assert got == []

    asyncio.run(run())
    wanted = [
        'Publish Violation - Subject "$KV.deepinfer_registry.scheduler.fake"',
        'Subscription Violation - Subject "deepinfer.kv.>"',
        'Publish Violation - Subject "deepinfer.kv.kvstore.forged"',
    ]
    deadline = time.monotonic() + 20  # the server writes its log on its own time
    while not all(w in (log := mesh.nats.log_tail(100_000)) for w in wanted):
        assert time.monotonic() < deadline, [w for w in wanted if w not in log]
        time.sleep(0.1)
