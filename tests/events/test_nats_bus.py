"""EventBus: JSON pub/sub, Nats-Msg-Id deduplication, and publishing that never fails the caller."""

from __future__ import annotations

import asyncio
import socket

import pytest
from nats.js.api import StreamConfig

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus, barrier


@pytest.mark.timeout(60)
def test_json_pub_sub_with_wildcards_survives_bad_messages(nats_server, wait_until):
    async def main():
        async with EventBus(name="test") as bus:
            await bus.connect(nats_server.url)
            got: list[tuple[str, dict]] = []

            async def handler(subject, payload):
                if payload.get("boom"):
                    raise RuntimeError("handler bug")
                got.append((subject, payload))

            await bus.subscribe(subjects.kv_wildcard(), handler)
            await bus.nc.publish(subjects.kv_subject("kvstore", "r0"), b"not json")  # a foreign, malformed message
            await bus.nc.publish(subjects.kv_subject("kvstore", "r0"), b"[1, 2]")  # JSON, but not an object
            assert await bus.publish(subjects.kv_subject("kvstore", "r0"), {"boom": True})
            sent = [{"stored": ["ab12", "cd34"], "tier": "gpu", "n": i, "f": 0.5, "none": None} for i in range(5)]
            for i, payload in enumerate(sent):
                assert await bus.publish(subjects.kv_subject("kvstore", f"r{i % 2}"), payload)
            await bus.publish(subjects.experts_subject("r0"), {"ignored": True})  # another subject tree
            await wait_until(lambda: len(got) == 5, 5)
            assert [p for _, p in got] == sent
            assert [s for s, _ in got] == [subjects.kv_subject("kvstore", f"r{i % 2}") for i in range(5)]
            assert bus.published == 7 and bus.dropped == 0

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_barrier_orders_a_subscription_before_another_connections_publish(nats_server, wait_until):
    """Subscribe, ``barrier``, then publish once from another connection: every such first message arrives (after
    ``nc.flush()`` alone about one in twenty did not: nats-py's PING overtakes the SUB still in its buffer)."""

    async def main():
        got: list[int] = []

        async def handler(subject, payload):
            got.append(payload["i"])

        for i in range(100):  # two new connections each time (the race shows most there)
            async with EventBus(name="pub") as pub, EventBus(name="sub") as sub:
                await pub.connect(nats_server.url)
                await sub.connect(nats_server.url)
                await sub.subscribe(subjects.experts_subject("r0"), handler)
                await barrier(sub.nc)
                assert await pub.publish(subjects.experts_subject("r0"), {"i": i})
                await barrier(pub.nc)  # the server has routed it: it is on its way to the subscriber
                await wait_until(lambda n=i + 1: len(got) == n, 10)
        assert got == list(range(100))

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_msg_id_header_deduplicates_in_a_jetstream_stream(nats_server):
    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            await bus.js.add_stream(StreamConfig(name="KVEVENTS", subjects=["deepinfer.kv.>"], duplicate_window=60))
            for msg_id in ["batch-1", "batch-1", "batch-2", "batch-1"]:
                assert await bus.publish(subjects.kv_subject("kvstore", "r0"), {"id": msg_id}, msg_id=msg_id)
            await bus.nc.flush()
            # core publishes: the stream stores them asynchronously, so wait for the two distinct ids to land
            for _ in range(50):
                info = await bus.js.stream_info("KVEVENTS")
                if info.state.messages >= 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # and give a duplicate the chance to show up if dedupe were broken
            info = await bus.js.stream_info("KVEVENTS")
            assert info.state.messages == 2
            msg = await bus.js.get_msg("KVEVENTS", seq=1)
            assert msg.headers["Nats-Msg-Id"] == "batch-1"

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_programming_errors_raise_but_nats_trouble_does_not(nats_server):
    async def main():
        bus = EventBus()
        assert await bus.publish("deepinfer.kv.r0", {"a": 1}) is False  # never connected: dropped, no raise
        assert bus.dropped == 1
        await bus.connect(nats_server.url)
        with pytest.raises(TypeError):
            await bus.publish("deepinfer.kv.r0", {"obj": object()})
        with pytest.raises(ValueError):
            await bus.publish("deepinfer.kv.r0", {"x": float("nan")})  # JSON has no NaN
        with pytest.raises(TypeError):
            await bus.publish("deepinfer.kv.r0", [1, 2])  # type: ignore[arg-type]
        await bus.close()
        assert await bus.publish("deepinfer.kv.r0", {"a": 1}) is False  # closed: dropped, no raise
        assert bus.dropped == 2
        await bus.close()  # idempotent

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_connect_to_nothing_fails_within_the_timeout():
    with socket.socket() as sock:  # a port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def main():
        bus = EventBus()
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
            await bus.connect(f"nats://127.0.0.1:{port}", timeout_s=1.0)
        assert not bus.connected

    asyncio.run(main())
