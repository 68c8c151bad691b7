"""A resume point offloaded by one replica serves another (issue 5): the launcher's mesh — NATS, the
kvstore, two replicas, the balancer — with a device cache of one resume point, so every older one moves to
the kvstore; the second replica learns of it from the kvstore's KV events and fetches it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import grpc
import nats
import pytest

from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.rpc.channel import open_channel
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from serving.launched import launched_mesh

pytestmark = pytest.mark.timeout(300)
VOCAB = 129280


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("kv_replicas")
    env = dict(DEEPINFER_PREFIX_CACHE_RESUME_POINTS="1", DEEPINFER_BATCH_INVARIANT="1",
               DEEPINFER_INTERNAL_TOKEN="test-internal-token")  # for the mesh and this test  # fmt: skip
    with launched_mesh(tmp, make_tiny_model(tmp / "model", seed=8), **env) as m:
        yield m


async def submit(address: str, rid: str, ids: list[int]) -> tuple[list[int], int]:
    async with open_channel(address) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        req = scheduler_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        )  # fmt: skip
        tokens, cached = [], 0
        async for ev in stub.Submit(req, timeout=60):
            tokens += list(ev.token_ids)
            cached = max(cached, ev.cached_tokens)
        return tokens, cached


def test_a_resume_point_offloaded_by_one_replica_is_a_hit_on_the_other(mesh) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(2, VOCAB) for _ in range(45)]
    a, b = mesh.endpoints["scheduler-0"], mesh.endpoints["scheduler-1"]

    async def run() -> tuple:
        events: list[dict] = []
        nc = await nats.connect(mesh.nats.url)  # the mesh's own server: its admin user

        async def on_msg(msg) -> None:
            events.extend(json.loads(msg.data)["events"])

        await nc.subscribe("deepinfer.kv.>", cb=on_msg)
        first = await submit(a, "a", prompt)  # resume points at 45 and 47: the first moves to the kvstore
        deadline, n = time.monotonic() + 30, 0
        while True:  # the KV event reaches replica 1 within a few hundred ms
            n += 1
            got = await submit(b, f"b{n}", prompt + [rng.randrange(2, VOCAB) for _ in range(6)])
            if got[1] or time.monotonic() > deadline:
                await asyncio.sleep(0.3)  # the last batches of events
                await nc.close()
                return first, got, events
            await asyncio.sleep(0.2)

    first, (tokens, cached), events = asyncio.run(run())
    assert cached == 45 and len(tokens) == 3 and len(first[0]) == 3
    seen = {(e["type"], e["tier"], e["reason"], e.get("position")) for e in events}
    # replica 0's device cache: the prompt-end point stored, then offloaded; the kvstore stores it (host, disk)
    assert {("stored", "device", "snapshot", 45), ("removed", "device", "offloaded", 45),
            ("stored", "host", "put", 45), ("stored", "disk", "put", 45)} <= seen, seen  # fmt: skip


def test_a_request_moved_off_a_dead_replica_resumes_from_the_kvstore(mesh) -> None:
    """Last (it kills a worker). A long stream runs on one replica; another prompt there pushes the stream's
    prompt-end resume point out to the kvstore; the stream's worker dies; the balancer moves the stream to the other
    replica, which resumes from the kvstore's copy instead of recomputing, and the stream is token-exact."""
    rng = random.Random(7)
    prompt, push = [rng.randrange(2, VOCAB) for _ in range(45)], [rng.randrange(2, VOCAB) for _ in range(45)]

    def gen(salt: str | None = None) -> generation_pb2.GenerateRequest:
        # long enough to outlast the push and the kill (a second or two; a token takes ~45 ms on 2 cores: ~7 s)
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
        return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling,
                                              cache_salt=salt)  # fmt: skip

    async def run() -> tuple[list[int], list]:
        async with grpc.aio.insecure_channel(mesh.endpoints["grpc"]) as ch:  # the public API
            stub = generation_pb2_grpc.GenerationStub(ch)
            # the undisturbed reference, under a salt of its own (it shares no cached state with the stream)
            ref = [t async for m in stub.Generate(gen("reference"), timeout=300) for t in m.token_ids]
            puts: list[dict] = []
            nc = await nats.connect(mesh.nats.url)

            async def on_msg(msg) -> None:
                puts.extend(e for e in json.loads(msg.data)["events"] if e["tier"] == "host" and e["type"] == "stored")

            await nc.subscribe("deepinfer.kv.>", cb=on_msg)
            call, msgs = stub.Generate(gen(), timeout=300), []
            async for m in call:
                msgs.append(m)
                if sum(len(x.token_ids) for x in msgs) >= 3:
                    break
            loads = (await stub.GetLoads(generation_pb2.GetLoadsRequest())).replicas
            address = next(r.replica_id for r in loads if r.running_requests)
            victim = next(n for n, a in mesh.endpoints.items() if a == address).replace("scheduler", "worker")
            before = len(puts)
            await submit(address, "push", push)  # its resume point pushes the stream's out to the kvstore
            deadline = time.monotonic() + 30
            while len(puts) == before:  # the kvstore stored it; the other replica learns of it the same way
                assert time.monotonic() < deadline, "nothing reached the kvstore"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            os.kill(dict(mesh.procs)[victim].pid, signal.SIGKILL)
            msgs += [m async for m in call]
            await nc.close()
            return ref, msgs

    ref, msgs = asyncio.run(run())
    assert [t for m in msgs for t in m.token_ids] == ref
    assert msgs[-1].finished.usage.cached_tokens_by_tier["kvstore"] >= 45  # resumed from the kvstore's copy
