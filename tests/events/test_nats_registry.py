"""Registry and load reports against a real JetStream KV bucket: register, expire, deregister, report."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from deepinfer.events.bus import EventBus
from deepinfer.events.load import LoadReporter, LoadView
from deepinfer.events.registry import Registration, Registry, RegistryView


def _reg(instance_id: str = "w0", kind: str = "worker", **kw) -> Registration:
    fields = {"address": "10.0.0.5:50051", "role": "decode", "model": "deepseek-v4", "capacity": {"kv_pages": 4096}}
    return Registration(instance_id, kind, **(fields | kw))


@pytest.mark.timeout(60)
def test_register_is_seen_with_all_fields_then_deregister_removes_at_once(nats_server, wait_until):
    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            view = RegistryView(bus)
            await view.start()
            assert view.instances() == []
            reg = Registry(bus, _reg(), ttl_s=60)  # (an entry gone before its TTL was deleted, not expired)
            assert await reg.start()
            other = Registry(bus, _reg("s0", "scheduler", address="[::1]:7000", role="mixed", capacity={}), ttl_s=60)
            await other.start()
            await wait_until(lambda: len(view.instances()) == 2, 2)
            assert view.instances("worker") == [reg.registration]  # every field round-trips
            assert view.get("scheduler", "s0") == other.registration
            assert [r.kind for r in view.instances()] == ["scheduler", "worker"]

            await reg.update(capacity={"kv_pages": 10})
            await wait_until(lambda: view.get("worker", "w0").capacity == {"kv_pages": 10}, 2)

            await reg.stop()  # deregister: a delete marker, seen by the watcher
            await wait_until(lambda: view.get("worker", "w0") is None, 2)
            assert await view.resync()  # a full re-read agrees
            assert [r.instance_id for r in view.instances()] == ["s0"]
            await other.stop()
            await view.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_instance_that_stops_refreshing_expires_after_its_ttl(nats_server, wait_until):
    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            view = RegistryView(bus, resync_s=30)  # expiry must come through the watcher (marker), not a re-read
            await view.start()
            reg = Registry(bus, _reg(), ttl_s=2)
            await reg.start()
            await wait_until(lambda: view.get("worker", "w0") is not None, 2)
            await asyncio.sleep(2.5)  # refreshed every 2/3 s: still alive past one TTL
            assert view.get("worker", "w0") is not None
            await reg.refresh()
            last_put = time.monotonic()
            await reg.stop(deregister=False)  # a crash: no delete, no more refreshes
            await wait_until(lambda: view.get("worker", "w0") is None, 6)
            gone_after = time.monotonic() - last_put
            assert 1.5 < gone_after < 5.0, gone_after  # TTL 2 s (+ marker and delivery slack under load)
            assert await view.resync() and view.instances() == []
            await view.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_read_cut_short_keeps_the_snapshot(nats_server, wait_until):
    """A re-read that returns fewer keys than the stream holds (a server going away answers a new watcher with
    nothing pending: nats-py then ends the read at once) is not reconciled: the live instances stay for the outage
    that follows; the next full read reconciles again."""

    class _Cut:  # the watcher such a server gives: the end marker first
        async def updates(self, timeout=None):
            return None

        async def stop(self):
            return None

    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            view = RegistryView(bus, resync_s=30)
            await view.start()
            reg = Registry(bus, _reg("s0", "scheduler"), ttl_s=5)
            await reg.start()
            await wait_until(lambda: view.get("scheduler", "s0") is not None, 2)
            assert await view.resync()
            kv = view._kv
            real = kv.watchall

            async def cut(*a, **kw):
                return _Cut()

            kv.watchall = cut
            assert not await view.resync()
            assert view.get("scheduler", "s0") == reg.registration
            kv.watchall = real
            assert await view.resync() and view.get("scheduler", "s0") == reg.registration
            await reg.stop()
            await view.close()

    asyncio.run(main())


def test_registration_validation_and_json():
    reg = _reg()
    assert Registration.from_json(reg.to_json()) == reg
    extra = json.loads(reg.to_json()) | {"added_in_v2": 1}
    assert Registration.from_json(json.dumps(extra).encode()) == reg  # unknown fields are ignored
    assert reg.key == "worker.w0"
    for bad in [
        {"address": "nohost"},
        {"address": "h:0"},
        {"address": "h:99999"},
        {"address": ":80"},
        {"kind": "gateway"},
        {"instance_id": "w.0"},
        {"role": "pre fill"},
        {"capacity": [1]},
    ]:
        with pytest.raises(ValueError):
            _reg(**bad)
    with pytest.raises(ValueError):
        Registration.from_json(b'{"instance_id": "w0"}')  # required fields missing
    with pytest.raises(ValueError):
        Registration.from_json(b"[]")


@pytest.mark.parametrize("ttl", [0, 0.5, 2.5, True, 61])
def test_ttl_must_be_a_whole_number_of_seconds(ttl):
    with pytest.raises(ValueError, match="ttl_s"):
        Registry(EventBus(), _reg(), ttl_s=ttl)


@pytest.mark.timeout(60)
def test_load_view_keeps_the_latest_report_and_drops_stale_ones(nats_server, wait_until):
    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            view = LoadView(bus)
            await view.start()
            running = iter(range(1000))
            reporter = LoadReporter(
                bus, "worker", "w0", lambda: {"running_requests": next(running), "free_kv_pages": 7}, period_s=0.2
            )
            failing = LoadReporter(bus, "worker", "w1", lambda: 1 / 0, period_s=0.2)
            await reporter.start()
            await failing.start()
            await wait_until(lambda: view.received >= 3, 3)
            sample = view.latest("worker")["w0"]
            assert sample.load["free_kv_pages"] == 7 and sample.load["running_requests"] >= 2
            assert sample.kind == "worker" and sample.age_s < 1.0 and sample.period_s == 0.2
            assert view.latest("scheduler") == {} and "w1" not in view.latest()
            assert failing.sent == 0 and failing.skipped >= 1
            await reporter.stop()
            await failing.stop()
            await wait_until(lambda: view.latest() == {}, 2)  # stale after 3 periods (0.6 s)
            assert view.get("worker", "w0") is None
            await view.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_service_s_presence_registers_under_the_ttl_of_its_setting(nats_server, wait_until, monkeypatch):
    """``DEEPINFER_PRESENCE_TTL_S`` is the TTL of every service's registry entry (``serving.presence``): its
    registry is made with it, and its entry, no longer refreshed (a crash), expires (how soon after the TTL:
    ``test_an_instance_that_stops_refreshing_expires_after_its_ttl``)."""
    from deepinfer.serving.presence import Presence

    monkeypatch.setenv("DEEPINFER_NATS_URL", nats_server.url)
    monkeypatch.setenv("DEEPINFER_PRESENCE_TTL_S", "2")

    async def main():
        async with EventBus() as bus:
            await bus.connect(nats_server.url)
            view = RegistryView(bus, resync_s=30)
            await view.start()
            presence = Presence(_reg("s9", "scheduler"))
            await presence.start()
            await wait_until(lambda: view.get("scheduler", "s9") is not None, 10)
            assert presence.registry.ttl_s == 2
            await presence.registry.stop(deregister=False)  # a crash: no delete, no more refreshes
            await wait_until(lambda: view.get("scheduler", "s9") is None, 20)
            await presence.close()
            await view.close()

    asyncio.run(main())
