"""Events and discovery over NATS: facts about the system, never request payloads (docs/architecture.md, "Events
and discovery (NATS)").

- :mod:`.subjects`: every subject and bucket name, and token validation.
- :mod:`.auth`: one NATS user per service kind, its subject permissions, credentials in URLs.
- :mod:`.server`: run a real ``nats-server`` with JetStream (tests, single host).
- :mod:`.bus`: :class:`EventBus`, the asyncio connection; publishing never blocks or fails on NATS.
- :mod:`.registry`: :class:`Registration`, :class:`Registry` (register + refresh with a TTL) and
  :class:`RegistryView` (live snapshot that survives outages).
- :mod:`.load`: :class:`LoadReporter` and :class:`LoadView` (latest load per instance, stale ones dropped).
"""

from deepinfer.events.bus import EventBus
from deepinfer.events.load import LoadReporter, LoadSample, LoadView, ReplicaLoad
from deepinfer.events.registry import Registration, Registry, RegistryView
from deepinfer.events.server import NatsServer, server_url_or_start

__all__ = [
    "EventBus",
    "LoadReporter",
    "LoadSample",
    "LoadView",
    "NatsServer",
    "Registration",
    "Registry",
    "RegistryView",
    "ReplicaLoad",
    "server_url_or_start",
]
