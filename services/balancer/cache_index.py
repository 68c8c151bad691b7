"""Which replica holds which prompt prefix: the balancer's index of the replicas' prefix caches, for cache-aware
routing (``ReplicaSet.pick``; docs/routing.md).

Each scheduler publishes its own resume points as they are stored and removed (device-tier KV events on
``deepinfer.kv.scheduler.<instance>``: ``services/scheduler/kv_index.py``), with its address and page size. The
events carry hashes only, never a token: a one-way tag, the anchor of the resume point's chain hash, its position.
Per replica address the balancer files them in a ``RemoteIndex`` (the scheduler's own index of the kvstore's
entries), and ``cached`` walks a prompt's chain as the replica would (its fingerprint, the request's salt, full
pages) and derives each candidate's tag from the prompt's tokens: a match is a resume point of that replica whose
tokens are a prefix of the prompt. DeepSeek-V4's state is a hybrid: a prefix is reusable only up to a resume point
(window and compressor state are snapshotted there, not per page), so the index holds resume points, not pages.

The index is soft state. Events published before the balancer subscribed are not replayed (the index fills as the
replicas store new resume points); a scheduler that restarts (another instance at the same address) starts its
replica's index afresh; an event that cannot be read is dropped and counted. A wrong entry costs a miss, never a
wrong token: the replica looks the prompt up in its own cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deepinfer.engine.prefix_cache import page_hashes, root_hash
from deepinfer.engine.remote_index import RemoteIndex
from deepinfer.events import subjects
from deepinfer.events.bus import EventBus
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


class CacheIndex:
    """The resume points of every replica, by address (module docstring)."""

    def __init__(self, capacity: int = 1 << 18, on_change: Callable[[str, int], None] | None = None) -> None:
        self.capacity = capacity  # entries per replica (least recently used ones go first)
        self.on_change = on_change  # (address, entries) after a message changed a replica's index
        self._by_address: dict[str, tuple[str, RemoteIndex]] = {}  # address -> (scheduler instance, its index)
        self.received = self.rejected = 0

    async def start(self, bus: EventBus) -> None:
        await bus.subscribe(subjects.kv_wildcard("scheduler"), self.on_message)

    def entries(self, address: str) -> int:
        got = self._by_address.get(address)
        return len(got[1]) if got is not None else 0

    async def on_message(self, subject: str, payload: dict[str, Any]) -> None:
        try:
            self.apply(payload)
        except (KeyError, ValueError, TypeError, AttributeError) as e:  # a malformed message must not stop the others
            self.rejected += 1
            log.warning("kv_event_ignored", subject=subject, error=str(e))

    def apply(self, payload: dict[str, Any]) -> None:
        address, instance, page_size = str(payload["address"]), str(payload["instance"]), int(payload["page_size"])
        if not address or page_size < 1:
            raise ValueError("a device KV message needs the replica's address and page size")
        for ev in payload["events"]:
            if ev.get("tier") != "device" or not ev.get("resume_point"):
                continue
            fingerprint = str(ev["fingerprint"])
            got = self._by_address.get(address)
            if got is None or got[0] != instance or got[1].fingerprint != fingerprint or got[1].page_size != page_size:
                got = self._by_address[address] = (instance, RemoteIndex(fingerprint, page_size, self.capacity))
            tag = bytes.fromhex(ev["tag"])
            if ev["type"] == "stored":
                got[1].add(bytes.fromhex(ev["anchor"]), int(ev["position"]), tag)
            elif ev["type"] == "removed":
                got[1].remove(tag)
            self.received += 1
        if self.on_change is not None:
            self.on_change(address, self.entries(address))

    def cached(self, addresses: Sequence[str], tokens: Sequence[int], salt: str | None) -> dict[str, int]:
        """The prompt tokens each replica holds a resume point for (0: none known)."""
        out, chains = {}, {}  # the prompt's chain, hashed once per (fingerprint, page size): replicas of one model
        limit = len(tokens) - 1
        for address in addresses:
            got = self._by_address.get(address)
            if got is None or limit < 1:
                out[address] = 0
                continue
            index = got[1]
            key = (index.fingerprint, index.page_size)
            root = root_hash(index.fingerprint, salt)
            if key not in chains:
                chains[key] = page_hashes(tokens, root, index.page_size, limit // index.page_size)
            hit = index.lookup(tokens, root, limit, chains[key])
            out[address] = hit.position if hit is not None else 0
        return out


__all__ = ["CacheIndex"]
