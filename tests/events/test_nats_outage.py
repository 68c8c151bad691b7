"""A NATS outage: the server dies and comes back on the same port and store while clients keep running."""

from __future__ import annotations

import asyncio
import os

import pytest

from deepinfer.events import subjects
from deepinfer.events.bus import EventBus
from deepinfer.events.load import LoadReporter, LoadView
from deepinfer.events.registry import Registration, Registry, RegistryView


@pytest.mark.timeout(60)
def test_clients_ride_out_an_outage_and_reconnect_by_themselves(nats_server, wait_until):
    async def main():
        bus = EventBus(name="outage", reconnect_time_wait_s=0.2)
        await bus.connect(nats_server.url)
        view = RegistryView(bus, resync_s=30)  # after the reconnect: a fresh watcher and a re-read, not the timer
        await view.start()
        loads = LoadView(bus)
        await loads.start()
        reporter = LoadReporter(bus, "worker", "w0", lambda: {"running_requests": 1}, period_s=0.2)
        await reporter.start()
        w0 = Registry(bus, Registration("w0", "worker", "127.0.0.1:50051"), ttl_s=3)
        await w0.start()
        events: list[dict] = []

        async def on_kv(subject, payload):
            events.append(payload)

        await bus.subscribe(subjects.kv_wildcard(), on_kv)
        await wait_until(lambda: view.get("worker", "w0") is not None and "w0" in loads.latest(), 3)
        snapshot = view.instances()

        old_pid = nats_server.pid
        nats_server.stop()  # the outage
        assert old_pid is not None and not os.path.exists(f"/proc/{old_pid}")
        await wait_until(lambda: not bus.connected, 5)
        assert await bus.publish(subjects.kv_subject("kvstore", "r0"), {"during": "outage"})  # buffered, no raise
        assert await view.resync() is False  # a re-read fails quietly, as do the watcher and the refresher
        await asyncio.sleep(1.5)
        assert view.instances() == snapshot  # the last known snapshot is still served
        skipped = reporter.skipped
        await asyncio.sleep(0.5)
        assert reporter.skipped > skipped  # reports are skipped, not buffered
        assert loads.latest() == {}  # no load is better than a stale one

        nats_server.start()  # same port, same store dir
        await wait_until(lambda: bus.connected, 5)  # reconnects by itself
        await wait_until(lambda: events == [{"during": "outage"}], 3)  # the buffered publish was delivered
        w1 = Registry(bus, Registration("w1", "worker", "127.0.0.1:50052"), ttl_s=3)
        assert await w1.start()
        took = await wait_until(lambda: view.get("worker", "w1") is not None, 5)
        assert took < 2, took
        await wait_until(lambda: "w0" in loads.latest(), 3)
        assert view.get("worker", "w0") is not None  # re-registered by its refresher
        await w1.stop()
        await wait_until(lambda: view.get("worker", "w1") is None, 2)
        await w0.stop()
        await reporter.stop()
        await loads.close()
        await view.close()
        await bus.close()
        assert bus.dropped == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_view_started_during_an_outage_catches_up(nats_server, wait_until):
    async def main():
        async with EventBus(reconnect_time_wait_s=0.2) as writer, EventBus(reconnect_time_wait_s=0.2) as reader:
            await writer.connect(nats_server.url)
            await reader.connect(nats_server.url)
            nats_server.stop()
            await wait_until(lambda: not reader.connected, 5)
            view = RegistryView(reader, resync_s=0.5)
            await view.start()  # does not raise; the snapshot is empty
            assert view.instances() == []
            nats_server.start()
            await wait_until(lambda: reader.connected and writer.connected, 5)
            reg = Registry(writer, Registration("g0", "grammar", "127.0.0.1:6000"), ttl_s=3)
            await reg.start()
            await wait_until(lambda: view.get("grammar", "g0") is not None, 3)
            await reg.stop()
            await view.close()

    asyncio.run(main())
