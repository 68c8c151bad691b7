"""The NATS server deepinfer starts: generated credentials, one user per service kind, per-kind subject permissions."""

from __future__ import annotations

import asyncio
import os
import stat

import nats
import pytest

from deepinfer.events import subjects
from deepinfer.events.auth import ADMIN, inbox_prefix, permissions, redact, url_user, with_credentials
from deepinfer.events.bus import EventBus, barrier
from deepinfer.events.registry import Registration, Registry, RegistryView


async def _bus(url: str, name: str) -> EventBus:
    bus = EventBus(name)  # a refused JetStream publish ends in an ack timeout (request_timeout_s)
    await bus.connect(url)
    return bus


def _reg(kind: str, instance_id: str) -> Registration:
    return Registration(instance_id, kind, "127.0.0.1:5000")


def test_url_helpers_and_the_permission_table():
    url = with_credentials("nats://10.0.0.1:4222", "scheduler", "p@ss/w:rd")
    assert url_user(url) == "scheduler" and "p%40ss%2Fw%3Ard" in url
    assert redact(url) == "nats://scheduler:***@10.0.0.1:4222" and redact("nats://h:1") == "nats://h:1"
    assert inbox_prefix(url) == "_INBOX.scheduler" and inbox_prefix("nats://h:1") is None
    assert with_credentials(url, "worker", "x") == "nats://worker:x@10.0.0.1:4222"  # replaces, never nests
    for kind in subjects.KINDS:
        pub = permissions(kind)["publish"]["allow"]
        assert [p for p in pub if p.startswith("$KV.")] == [f"$KV.deepinfer_registry.{kind}.>"]
        assert not any("STREAM.CREATE" in p or "STREAM.DELETE" in p or "PURGE" in p for p in pub)
        assert ("deepinfer.kv.>" in permissions(kind)["subscribe"]["allow"]) == (kind == "scheduler")
    assert "deepinfer.kv.kvstore.>" in permissions("kvstore")["publish"]["allow"]
    assert not any(p.startswith("deepinfer.kv.") for p in permissions("worker")["publish"]["allow"])


@pytest.mark.timeout(60)
def test_clients_without_valid_credentials_are_refused(nats_server):
    async def main():
        for url in (nats_server.address, with_credentials(nats_server.address, "scheduler", "wrong")):
            with pytest.raises(Exception, match="Authorization Violation"):
                await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
        for kind in subjects.KINDS:  # every kind's own credentials work
            bus = await _bus(nats_server.url_for(kind), kind)
            assert bus.connected
            await bus.close()

    asyncio.run(main())
    with pytest.raises(KeyError):
        nats_server.url_for("gateway")


@pytest.mark.timeout(60)
def test_only_schedulers_write_scheduler_registry_keys(nats_server, wait_until):
    async def main():
        admin = await _bus(nats_server.url, ADMIN)
        view = RegistryView(admin, resync_s=0.5)
        await view.start()
        balancer = await _bus(nats_server.url_for("balancer"), "balancer")
        scheduler = await _bus(nats_server.url_for("scheduler"), "scheduler")
        fake = Registry(balancer, _reg("scheduler", "fake"), ttl_s=5)
        assert not await fake.refresh()  # a publish violation: never acknowledged
        await wait_until(lambda: 'Publish Violation - Subject "$KV.deepinfer_registry.scheduler.fake"'
                         in nats_server.log_tail(200), 10)  # fmt: skip
        real = Registry(scheduler, _reg("scheduler", "real"), ttl_s=5)
        own = Registry(balancer, _reg("balancer", "b0"), ttl_s=5)  # every kind writes its own keys
        assert await real.refresh() and await own.refresh()
        await wait_until(lambda: {r.instance_id for r in view.instances()} == {"real", "b0"}, 10)
        # the balancer still watches the registry (its discovery), with its own credentials
        watcher = RegistryView(balancer, resync_s=0.5)
        await watcher.start()
        await wait_until(lambda: [r.instance_id for r in watcher.instances("scheduler")] == ["real"], 10)
        # a resync may find a key mid-rewrite (its refresh) and keep the snapshot (False): one of a few succeeds
        assert any([await watcher.resync() for _ in range(5)])
        with pytest.raises(nats.errors.TimeoutError):  # services may not create streams (the request is dropped)
            await scheduler.js.add_stream(name="EVIL", subjects=["deepinfer.kv.>"])
        assert "fake" not in {r.instance_id for r in view.instances()}
        await watcher.close()
        await view.close()
        for bus in (balancer, scheduler, admin):
            await bus.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_kv_events_are_published_by_their_kind_and_read_by_schedulers(nats_server, wait_until):
    """(A balancer reads the schedulers' device-tier events only: its cache-aware routing.)"""

    async def main():
        got: dict[str, list[str]] = {"scheduler": [], "worker": [], "balancer": []}
        buses = {k: await _bus(nats_server.url_for(k), k) for k in ("kvstore", "balancer", "scheduler", "worker")}
        for reader in got:

            async def on_kv(subject, payload, reader=reader):
                got[reader].append(payload["from"])

            wildcard = subjects.kv_wildcard("scheduler") if reader == "balancer" else subjects.kv_wildcard()
            await buses[reader].subscribe(wildcard, on_kv)
            await barrier(buses[reader].nc)  # the server has the subscription (or has refused it)
        await buses["balancer"].subscribe(subjects.kv_wildcard("kvstore"), lambda *a: got["balancer"].append("?"))
        await barrier(buses["balancer"].nc)  # (refused: the server has answered it)
        await buses["balancer"].publish(subjects.kv_subject("kvstore", "kv0"), {"from": "balancer"})  # refused
        await buses["kvstore"].publish(subjects.kv_subject("scheduler", "s0"), {"from": "kvstore-as-scheduler"})
        await buses["kvstore"].publish(subjects.kv_subject("kvstore", "kv0"), {"from": "kvstore"})
        await buses["scheduler"].publish(subjects.kv_subject("scheduler", "s0"), {"from": "scheduler"})
        await wait_until(lambda: len(got["scheduler"]) == 2 and got["balancer"], 10)
        assert sorted(got["scheduler"]) == ["kvstore", "scheduler"] and got["balancer"] == ["scheduler"]
        refused = ['"$G/user:worker" - Subscription Violation - Subject "deepinfer.kv.>"',
                   '"$G/user:balancer" - Subscription Violation - Subject "deepinfer.kv.kvstore.*"',
                   '"$G/user:balancer" - Publish Violation - Subject "deepinfer.kv.kvstore.kv0"',
                   '"$G/user:kvstore" - Publish Violation - Subject "deepinfer.kv.scheduler.s0"']  # fmt: skip
        missing = lambda: [line for line in refused if line not in nats_server.log_tail(5000)]  # noqa: E731
        try:
            await wait_until(lambda: not missing(), 10)
        except AssertionError:
            raise AssertionError(f"not in the server's log: {missing()}") from None
        assert got["worker"] == []  # the subscription itself was refused
        for bus in buses.values():
            await bus.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_the_generated_config_is_private_and_removed_on_close(tmp_path):
    from deepinfer.events.server import NatsServer

    server = NatsServer(store_dir=tmp_path / "store", log_file=tmp_path / "s.log").start()
    conf = server._conf_dir / "auth.conf"
    try:
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(conf.parent).st_mode) == 0o700
        assert server.credentials.passwords["scheduler"] in conf.read_text()
        assert server.credentials.passwords["scheduler"] not in repr(server)
    finally:
        server.close()
    assert not conf.parent.exists()
