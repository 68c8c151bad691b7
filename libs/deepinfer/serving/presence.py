"""A service's presence on the event bus: its registration (with a TTL it keeps refreshing) and, for
schedulers, its load reports. Optional: without ``DEEPINFER_NATS_URL`` nothing is published, and a NATS
server that is down never blocks or fails the data plane — registration is retried in the background.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from deepinfer import envs
from deepinfer.events import EventBus, LoadReporter, Registration, Registry
from deepinfer.events.auth import redact
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


def advertised(host: str, port: int) -> str:
    """The address others should dial: the bind host, or this machine's name when bound to all interfaces."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def instance_id(kind: str) -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return f"{kind}-{host}-{os.getpid()}"


class Presence:
    def __init__(
        self,
        registration: Registration,
        load: Callable[[], Mapping[str, Any]] | None = None,
        ttl_s: int | None = None,
        load_period_s: float = 1.0,
    ) -> None:
        """``ttl_s``: the registry entry's TTL (default ``DEEPINFER_PRESENCE_TTL_S``)."""
        ttl_s = envs.DEEPINFER_PRESENCE_TTL_S if ttl_s is None else ttl_s
        self.registration, self.load, self.ttl_s, self.load_period_s = registration, load, ttl_s, load_period_s
        self.bus: EventBus | None = None
        self.registry: Registry | None = None
        self.reporter: LoadReporter | None = None
        self._task: asyncio.Task | None = None
        self.on_connected: list[Callable[[EventBus], Awaitable[None]]] = []  # run once NATS is reached

    async def start(self) -> None:
        url = envs.DEEPINFER_NATS_URL
        if not url:
            return
        self._task = asyncio.create_task(self._connect(url))

    async def _connect(self, url: str) -> None:
        while True:
            bus = EventBus(self.registration.instance_id)
            try:
                await bus.connect(url, timeout_s=5)
                break
            except (ConnectionError, OSError) as e:
                log.warning("nats_unreachable", url=redact(url), error=str(e))
                await asyncio.sleep(2)
        self.bus = bus
        self.registry = Registry(bus, self.registration, ttl_s=self.ttl_s)
        await self.registry.start()
        if self.load is not None:
            r = self.registration
            self.reporter = LoadReporter(bus, r.kind, r.instance_id, self.load, period_s=self.load_period_s)
            await self.reporter.start()
        log.info("registered", kind=self.registration.kind, address=self.registration.address, nats=redact(url))
        for hook in self.on_connected:
            await hook(bus)

    async def close(self) -> None:
        """Deregister and disconnect (again: a no-op)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        reporter, registry, bus = self.reporter, self.registry, self.bus
        self.reporter = self.registry = self.bus = None
        if reporter is not None:
            await reporter.stop()
        if registry is not None:
            await registry.stop(deregister=True)
        if bus is not None:
            await bus.close()
