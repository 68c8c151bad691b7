"""The worker's bridge to the kvstore: resume points offloaded and fetched in the background.

The model runner is synchronous; this class runs the asyncio :class:`KVStoreClient` on its own event loop
in a daemon thread. ``put`` returns at once (the blob is encoded, or its encoding runs, off the caller's
thread; its transfer overlaps the next steps); ``fetch`` starts a transfer whose decoded result
(:func:`resume_format.decode`) is collected with ``completed``. A failed put is logged and counted, never raised:
the resume point is simply not there later. A failed fetch is reported with its reason, so the scheduler
recomputes the request instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from deepinfer.kvstore.client import KVStoreClient, KVStoreDataLoss
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


@dataclass
class Fetched:
    fetch_id: str
    payload: object | None  # the decoded resume point, or None on failure
    reason: str = ""


class RemoteResumeStore:
    def __init__(self, address: str, fingerprint: str, decode: Callable[[bytes], object], layout: str) -> None:
        self.address, self.fingerprint, self.decode, self.layout = address, fingerprint, decode, layout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-remote", daemon=True)
        self._thread.start()
        self._done: list[Fetched] = []
        self._exported: list[tuple[str, bool, str]] = []  # exports put (or failed): (snapshot id, ok, reason)
        self._lock = threading.Lock()
        self._put_done = threading.Condition(self._lock)  # an export was put (or failed)
        self._exporting: set[str] = set()  # exports whose put runs
        self._arrived = threading.Event()
        self.puts_failed = 0
        self._pending: set[Future] = set()
        self._puts: dict[bytes, asyncio.Task] = {}  # transfers in flight (a fetch of the same key waits)
        self._client = self._run(self._make_client()).result()

    async def _make_client(self) -> KVStoreClient:
        return KVStoreClient(self.address, timeout_s=30.0)

    def _run(self, coro: object) -> Future:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def put(
        self, key: bytes, data: bytes | Callable[[], bytes], meta: dict[str, str], export_id: str | None = None
    ) -> Future:
        """Store a blob in the background; ``data`` may be the function that makes it (run on a thread of this
        store's own: an encoding that waits for the device's copies never holds up the caller). ``export_id`` (a
        handoff's export): its completion is reported by :meth:`exported`."""

        async def send() -> None:
            ok, reason = True, ""
            try:
                blob = await asyncio.to_thread(data) if callable(data) else data
                await self._client.put(self.fingerprint, key, blob, meta, self.layout)
            except Exception as e:  # noqa: BLE001 - a lost offload only costs a future recompute
                self.puts_failed += 1
                ok, reason = False, type(e).__name__
                log.warning("kvstore_put_failed", key=key.hex()[:16], error=str(e))
            if export_id is not None:
                with self._lock:
                    self._exported.append((export_id, ok, reason))
                    self._exporting.discard(export_id)
                    self._put_done.notify_all()
                self._arrived.set()

        async def go() -> None:
            task = self._puts[key] = asyncio.ensure_future(send())
            try:
                await task
            finally:
                if self._puts.get(key) is task:
                    del self._puts[key]

        if export_id is not None:
            with self._lock:
                self._exporting.add(export_id)
        return self._run(go())

    def fetch(self, fetch_id: str, key: bytes) -> Future:
        async def go() -> None:
            if key in self._puts:  # offloaded a moment ago: let the transfer land first
                await asyncio.wait([self._puts[key]])
            try:
                got = await self._client.get(self.fingerprint, key)
                if got is None:
                    out = Fetched(fetch_id, None, "not_found")
                else:
                    out = Fetched(fetch_id, await asyncio.to_thread(self.decode, got[0]))
            except KVStoreDataLoss as e:
                out = Fetched(fetch_id, None, "data_loss")
                log.warning("kvstore_fetch_data_loss", key=key.hex()[:16], error=str(e))
            except grpc.aio.AioRpcError as e:
                out = Fetched(fetch_id, None, "unavailable" if e.code() == grpc.StatusCode.UNAVAILABLE else "error")
            except Exception as e:  # noqa: BLE001 - a bad blob must never take the worker down
                out = Fetched(fetch_id, None, "error")
                log.warning("kvstore_fetch_failed", key=key.hex()[:16], error=str(e))
            with self._lock:
                self._done.append(out)
            self._arrived.set()

        return self._run(go())

    def completed(self) -> list[Fetched]:
        """Fetches finished since the last call."""
        with self._lock:
            out, self._done = self._done, []
            self._arrived.clear()
        return out

    def exported(self) -> list[tuple[str, bool, str]]:
        """Exports put (or failed) since the last call: ``(export id, ok, reason)``."""
        with self._lock:
            out, self._exported = self._exported, []
        return out

    def wait(self, timeout_s: float) -> None:
        """Block until a fetch or an export completes or ``timeout_s`` passes (an idle step with transfers in
        flight)."""
        self._arrived.wait(timeout_s)

    def wait_exported(self, export_ids: list[str], timeout_s: float) -> bool:
        """Block until these exports are put (or failed), or ``timeout_s`` passes; whether they all were."""
        want = set(export_ids)
        with self._put_done:
            return self._put_done.wait_for(lambda: not want & self._exporting, timeout_s)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for every transfer in flight (tests, shutdown)."""
        for fut in list(self._pending):
            try:
                fut.result(timeout_s)
            except Exception:  # noqa: BLE001, S110 - failures are logged where they happen
                pass

    def close(self) -> None:
        self.flush(5.0)
        self._run(self._client.close()).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
