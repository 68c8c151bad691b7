"""KV events and registration on a real nats-server; a NATS server that is down never fails Put/Get."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus
from deepinfer.events.registry import RegistryView
from deepinfer.events.server import NatsServer
from deepinfer.kvstore.blob import BlobKey, Tier
from deepinfer.kvstore.client import KVStoreClient
from deepinfer.kvstore.keys import anchor, binding_meta, key_tag, resume_key
from deepinfer.serving.healthcheck import free_port
from services.kvstore.events import KVEventPublisher
from services.kvstore.store import StoreEvent

FP = "deepseek-v4-test-fp"
CHAIN, TAIL = b"\x01" * 16, b"\x02" * 16
AB = resume_key(FP, CHAIN, TAIL, 256)  # a resume point's key, bound to its meta


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(store_dir=tmp_path / "nats", log_file=tmp_path / "nats.log").start()
    try:
        yield server
    finally:
        server.close()


async def wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
def test_stored_and_removed_events_and_registration(nats_server, kvstore_factory, tmp_path):
    async def main():
        async with EventBus(name="test") as bus:
            await bus.connect(nats_server.url)
            messages: list[tuple[str, dict]] = []
            raw: list[bytes] = []  # the bytes on the wire

            async def on_kv(subject, payload):
                messages.append((subject, payload))

            async def on_raw(msg):
                raw.append(msg.data)

            await bus.subscribe(subjects.kv_wildcard(), on_kv)
            await bus.nc.subscribe(subjects.kv_wildcard(), cb=on_raw)
            view = RegistryView(bus, resync_s=0.5)
            await view.start()
            kv = kvstore_factory(tmp_path / "data", DEEPINFER_NATS_URL=nats_server.url_for("kvstore"))
            await wait_for(lambda: view.instances("kvstore"), 10)
            (reg,) = view.instances("kvstore")
            assert reg.address == kv.address and reg.capacity["max_blob_bytes"] == 1024**3
            async with KVStoreClient(kv.address) as c:
                await c.put(FP, AB, b"payload", binding_meta(CHAIN, TAIL, 256), "v1")
                await c.put(FP, b"\xcd" * 32, b"other", resume_point=False)  # not a resume point: no binding
                assert await c.remove(FP, [AB]) == 1

            def events():
                return [e for _, m in messages for e in m["events"]]

            await wait_for(lambda: len(events()) >= 6, 5)
            subject, first = messages[0]
            assert subject == subjects.kv_subject("kvstore", reg.instance_id) and first["instance"] == reg.instance_id
            got = {(e["type"], e["tier"], e["tag"], e["reason"]) for e in events()}
            ab, cd = key_tag(FP, AB).hex(), key_tag(FP, b"\xcd" * 32).hex()
            assert got == {
                ("stored", "disk", ab, "put"), ("stored", "host", ab, "put"),
                ("stored", "disk", cd, "put"), ("stored", "host", cd, "put"),
                ("removed", "disk", ab, "removed"), ("removed", "host", ab, "removed"),
            }  # fmt: skip
            stored_ab = next(e for e in events() if e["tag"] == ab and e["type"] == "stored")
            assert stored_ab == {"type": "stored", "tier": stored_ab["tier"], "fingerprint": FP, "tag": ab,
                                 "anchor": anchor(CHAIN).hex(), "position": 256, "resume_point": True,
                                 "reason": "put"}  # fmt: skip
            assert next(e for e in events() if e["tag"] == cd)["resume_point"] is False
            assert "anchor" not in next(e for e in events() if e["tag"] == cd)
            await wait_for(lambda: len(raw) == len(messages), 5)
            for secret in (AB, b"\xcd" * 32, CHAIN, TAIL):  # neither keys nor the binding ever reach NATS
                assert not any(secret.hex().encode() in data for data in raw)
            assert kv.stop() == 0
            await wait_for(lambda: not view.instances("kvstore"), 10)  # deregistered on SIGTERM
            await view.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_nats_down_never_blocks_put_or_get(kvstore_factory):
    dead_url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    kv = kvstore_factory(None, DEEPINFER_NATS_URL=dead_url)

    async def main():
        async with KVStoreClient(kv.address, timeout_s=5) as c:
            start = time.monotonic()
            for i in range(20):
                meta = binding_meta(CHAIN, TAIL, i + 1)
                await c.put(FP, resume_key(FP, CHAIN, TAIL, i + 1), b"x" * 1000, meta)
                assert await c.get(FP, resume_key(FP, CHAIN, TAIL, i + 1)) == (b"x" * 1000, meta)
            assert time.monotonic() - start < 3

    asyncio.run(main())
    assert kv.stop() == 0


class FakeBus:
    def __init__(self, accept: bool = True) -> None:
        self.accept, self.sent = accept, []

    async def publish(self, subject, payload, *, msg_id=None) -> bool:
        if self.accept:
            self.sent.append((subject, payload))
        return self.accept


def store_event(i: int) -> StoreEvent:
    key = resume_key(FP, CHAIN, TAIL, i + 1)
    return StoreEvent("stored", Tier.HOST, BlobKey(FP, key), "put", 10, binding_meta(CHAIN, TAIL, i + 1))


def test_publisher_batches_buffers_until_connected_and_counts_drops():
    async def main():
        bus: FakeBus | None = None
        drops: list[int] = []
        pub = KVEventPublisher("kv-1", lambda: bus, period_s=0.05, max_buffered=150, on_drop=drops.append)
        await pub.start()
        threads = [threading.Thread(target=lambda k=k: [pub.on_event(store_event(k * 100 + i)) for i in range(80)])
                   for k in range(2)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pub.on_event(StoreEvent("removed", Tier.DISK, None, "corrupt"))  # no key: not published
        await asyncio.sleep(0.15)  # no bus yet: kept, bounded (the 10 oldest dropped)
        assert sum(drops) == 10
        bus = FakeBus()
        await wait_for(lambda: sum(len(p["events"]) for _, p in bus.sent) == 150, 2)
        assert [len(p["events"]) for _, p in bus.sent] == [64, 64, 22]
        assert {s for s, _ in bus.sent} == {subjects.kv_subject("kvstore", "kv-1")}
        assert all(p["instance"] == "kv-1" for _, p in bus.sent)
        first = bus.sent[0][1]["events"][0]
        assert first == {"type": "stored", "tier": "host", "fingerprint": FP, "tag": first["tag"],
                         "anchor": anchor(CHAIN).hex(), "position": first["position"], "resume_point": True,
                         "reason": "put"}  # fmt: skip
        bus = FakeBus(accept=False)  # NATS refuses (buffer full): dropped and counted, never raised
        pub.on_event(store_event(1))
        await pub.stop()
        assert sum(drops) == 11 and pub.published == 150

    asyncio.run(main())
