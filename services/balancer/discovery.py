"""The balancer's view of its replicas: the static ``--scheduler`` list plus the schedulers registered on NATS."""

from __future__ import annotations

from typing import Any

from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class Discovery:
    """Keeps the balancer's replicas (``service.set_replicas``) = the static ``--scheduler`` list ∪ the
    schedulers registered on NATS, and feeds ``service.cache`` (``cache_index.CacheIndex``) the replicas' KV events
    from the same connection.

    While NATS is down the registry view serves its last snapshot, so routing goes on unchanged."""

    def __init__(self, service: Any, static: list[str], period_s: float = 0.5) -> None:
        self.service, self.static, self.period_s = service, list(static), period_s
        self.bus = None
        self.view = None
        self._task = None

    async def start(self) -> None:
        """Follow the registry from a background task (connecting with backoff while NATS cannot be reached:
        the static replicas serve meanwhile)."""
        import asyncio

        from deepinfer import envs

        if envs.DEEPINFER_NATS_URL:
            self._task = asyncio.create_task(self._follow(envs.DEEPINFER_NATS_URL))

    async def _follow(self, url: str) -> None:
        from deepinfer.events import EventBus, RegistryView
        from deepinfer.events.auth import redact
        from deepinfer.rpc.channel import Backoff

        backoff = Backoff(max_s=5.0)
        while True:
            bus = EventBus("balancer-discovery")
            try:
                await bus.connect(url, timeout_s=10)
                break
            except (ConnectionError, OSError):
                log.warning("nats_unreachable", url=redact(url))
                await backoff.wait()
        self.bus = bus
        cache = getattr(self.service, "cache", None)
        if cache is not None:  # the replicas' resume points: cache-aware routing
            await cache.start(bus)
        self.view = RegistryView(self.bus)
        await self.view.start()
        await self._sync()

    async def _sync(self) -> None:
        import asyncio

        while True:
            found = [r.address for r in self.view.instances("scheduler")]
            self.service.set_replicas(self.static + sorted(found))
            await asyncio.sleep(self.period_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.view is not None:
            await self.view.close()
        if self.bus is not None:
            await self.bus.close()
