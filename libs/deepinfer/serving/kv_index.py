"""A scheduler's view of what the kvstores hold, kept from their KV events on NATS.

Every kvstore publishes what it stores and removes, per tier (``deepinfer.kvstore.events``). A scheduler
whose worker moves resume points to and from a kvstore indexes the resume points stored for its own model
fingerprint, so a prefix offloaded by any replica is a hit on every replica. An entry leaves the index when
no tier holds it any more (or when a fetch of it fails).
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.scheduler import Scheduler
from deepinfer.events import subjects
from deepinfer.events.bus import EventBus
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class KVIndexFollower:
    def __init__(self, scheduler: Scheduler, fingerprint: str) -> None:
        self.scheduler, self.fingerprint = scheduler, fingerprint
        self.tiers: dict[str, set[str]] = {}  # blob key (hex) -> tiers holding it

    async def start(self, bus: EventBus) -> None:
        await bus.subscribe(subjects.kv_wildcard(), self.on_message)

    async def on_message(self, subject: str, payload: dict[str, Any]) -> None:
        for ev in payload.get("events", []):
            try:
                self.apply(ev)
            except (KeyError, ValueError, TypeError) as e:  # a malformed event must not stop the others
                log.warning("kv_event_ignored", subject=subject, error=str(e))

    def apply(self, ev: dict[str, Any]) -> None:
        if ev.get("fingerprint") != self.fingerprint or not ev.get("resume_point"):
            return
        meta, key = ev.get("meta") or {}, str(ev["key"])
        if "base" not in meta:
            return
        base = bytes.fromhex(meta["base"])
        tail = tuple(int(t) for t in meta["tail"].split(",") if t)
        held = self.tiers.setdefault(key, set())
        if ev["type"] == "stored":
            held.add(str(ev["tier"]))
            self.scheduler.add_remote(base, tail, int(meta["position"]), bytes.fromhex(key))
        elif ev["type"] == "removed":
            held.discard(str(ev["tier"]))
            if not held:
                del self.tiers[key]
                self.scheduler.remove_remote(base, tail)
