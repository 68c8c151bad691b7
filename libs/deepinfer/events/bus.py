"""The event bus: one asyncio NATS connection per process, carrying JSON events (never requests or KV data).

::

    bus = EventBus(name="scheduler-0")
    await bus.connect(url)
    await bus.subscribe(subjects.load_wildcard(), on_load)  # async def on_load(subject: str, payload: dict)
    await bus.publish(subjects.load_subject("worker", "w0"), {"running_requests": 3})
    await bus.close()

Contracts:

- **Publishing never fails because of NATS and never waits for a server that is down.** While the
  connection is down nats-py buffers messages (up to ``pending_size`` bytes) and sends them after
  reconnecting; a message that cannot even be buffered (buffer full, connection closed, never connected)
  is dropped and counted in :attr:`EventBus.dropped`. :meth:`EventBus.publish` returns whether the
  message was handed to the client. Programming errors (a payload that is not JSON, a bad subject) raise.
- The connection reconnects forever (``max_reconnect_attempts=-1``) every ``reconnect_time_wait`` seconds.
  Disconnects, reconnects and errors are logged as one line each (repeats of the same error during one
  outage go to debug), never as tracebacks.
- Payloads are JSON objects (UTF-8, no NaN/Infinity). An optional ``msg_id`` becomes the ``Nats-Msg-Id``
  header, which JetStream streams capturing the subject use to drop duplicates within their window.
- Subscribers receive decoded dicts; a message that is not a JSON object, or a handler that raises, is
  logged and skipped, so one bad message never ends a subscription. Handlers must be idempotent
  (delivery is at-most-once for core subjects and at-least-once through JetStream).
- Listeners added with :meth:`EventBus.on_reconnect` run after every reconnect (e.g. to re-sync state).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from deepinfer.events.auth import inbox_prefix, redact
from deepinfer.telemetry import get_logger

__all__ = ["EventBus", "Handler", "OnceLog", "barrier", "decode", "encode", "quietly", "stop_tasks", "wait_event"]

log = get_logger(__name__)

Handler = Callable[[str, dict[str, Any]], Awaitable[None]]
ReconnectListener = Callable[[], Awaitable[None] | None]
MSG_ID_HEADER = "Nats-Msg-Id"


def encode(payload: Mapping[str, Any]) -> bytes:
    """Compact JSON bytes of ``payload``; ``TypeError``/``ValueError`` if it is not strictly JSON-serialisable."""
    if not isinstance(payload, Mapping):
        raise TypeError(f"event payloads are JSON objects (mappings), got {type(payload).__name__}")
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> dict[str, Any]:
    """The JSON object in ``data``; ``ValueError`` if it is not one."""
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"event payload is a JSON {type(value).__name__}, not an object")
    return value


class OnceLog:
    """Logs each distinct failure once, as one warning line, until :meth:`ok` (repeats go to debug)."""

    def __init__(self, event: str) -> None:
        self.event, self.last = event, ""

    def failed(self, exc: BaseException, **kw: Any) -> None:
        """Report a failure: a warning line if it differs from the previous one, else a debug line."""
        text = repr(exc)
        (log.debug if text == self.last else log.warning)(self.event, error=text, **kw)
        self.last = text

    def ok(self) -> None:
        """The operation succeeded: the next failure is logged again."""
        self.last = ""


async def stop_tasks(*tasks: asyncio.Task[Any] | None, timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout_s`` (never hangs, never raises).

    Loops must also check a stop flag: on Python 3.11 ``asyncio.wait_for`` (used inside nats-py) can swallow
    a cancellation that arrives just as the awaited result does.
    """
    live = [t for t in tasks if t is not None and not t.done()]
    for task in live:
        task.cancel()
    if live:
        _, pending = await asyncio.wait(live, timeout=timeout_s)
        for task in pending:
            log.warning("task_did_not_stop", task=task.get_name(), timeout_s=timeout_s)


async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set or ``timeout_s`` passes, then clear it (``asyncio.timeout``, not wait_for)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    event.clear()


class EventBus:
    """An asyncio NATS connection with the publishing and logging contracts of the module docstring."""

    def __init__(
        self,
        name: str | None = None,
        *,
        reconnect_time_wait_s: float = 0.5,
        pending_size: int = 8 * 1024 * 1024,
        request_timeout_s: float = 2.0,
    ) -> None:
        self.name = name
        self.reconnect_time_wait_s = reconnect_time_wait_s
        self.pending_size = pending_size
        self.request_timeout_s = request_timeout_s  # JetStream API calls (KV, stream info)
        self.published = 0  # messages handed to the client (sent or buffered)
        self.dropped = 0  # messages that could not even be buffered
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._listeners: list[ReconnectListener] = []
        self._errors = OnceLog("nats_error")  # one line per distinct error during an outage
        self._down_since: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- connection ---------------------------------------------------------------------------------------

    async def connect(self, url: str, *, timeout_s: float = 10.0) -> None:
        """Connect to ``url``; ``ConnectionError`` if the first connection does not succeed within ``timeout_s``.

        After that first success the client reconnects by itself, forever. Credentials come in the URL
        (``nats://user:password@host:port``, see ``events/auth.py``); replies then use the inbox ``_INBOX.<user>``.
        """
        if self._nc is not None:
            raise RuntimeError("EventBus.connect called twice")
        nc = Client()
        prefix = inbox_prefix(url)
        try:
            await asyncio.wait_for(
                nc.connect(
                    url,
                    name=self.name,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=self.reconnect_time_wait_s,  # type: ignore[arg-type]
                    connect_timeout=2,
                    pending_size=self.pending_size,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    closed_cb=self._on_closed,
                    **({"inbox_prefix": prefix} if prefix else {}),
                ),
                timeout_s,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await quietly(nc.close(), "nats close")
            raise ConnectionError(f"could not connect to NATS at {redact(url)} within {timeout_s} s: {exc!r}") from exc
        self._nc = nc
        self._js = nc.jetstream(timeout=self.request_timeout_s)
        log.info("nats_connected", url=redact(url), name=self.name)

    @property
    def connected(self) -> bool:
        """Whether the connection is up right now (``False`` while reconnecting or after :meth:`close`)."""
        return self._nc is not None and self._nc.is_connected

    @property
    def nc(self) -> Client:
        """The underlying nats-py client (``RuntimeError`` before :meth:`connect`)."""
        if self._nc is None:
            raise RuntimeError("EventBus is not connected; call connect() first")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context, with API calls timing out after ``request_timeout_s``."""
        if self._js is None:
            raise RuntimeError("EventBus is not connected; call connect() first")
        return self._js

    def on_reconnect(self, listener: ReconnectListener) -> None:
        """Run ``listener`` (sync or async) after every reconnect; its errors are logged, not raised."""
        self._listeners.append(listener)

    def remove_reconnect_listener(self, listener: ReconnectListener) -> None:
        """Forget a listener added with :meth:`on_reconnect` (no error if it is not there)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def close(self) -> None:
        """Flush what can be flushed (briefly) and close the connection. Idempotent."""
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None:
            self._down_since = time.monotonic()  # closing: the disconnect that follows is no outage
            await quietly(nc.close(), "nats close")

    async def __aenter__(self) -> EventBus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- publish / subscribe ------------------------------------------------------------------------------

    async def publish(self, subject: str, payload: Mapping[str, Any], *, msg_id: str | None = None) -> bool:
        """Publish ``payload`` as JSON on ``subject``; ``True`` if sent or buffered, ``False`` if dropped.

        Never raises because NATS is down or the buffer is full (see the module docstring).
        """
        data = encode(payload)
        nc = self._nc
        if nc is None:
            self.dropped += 1
            return False
        headers = {MSG_ID_HEADER: msg_id} if msg_id else None
        try:
            await nc.publish(subject, data, headers=headers)
        except nats.errors.BadSubjectError:
            raise ValueError(f"invalid NATS subject {subject!r}") from None
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("nats_publish_dropped", subject=subject, dropped=self.dropped, error=repr(exc))
            return False
        self.published += 1
        return True

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        """Call ``await handler(subject, payload)`` for every JSON object published on ``subject``.

        ``subject`` may hold wildcards. Returns the subscription (``await sub.unsubscribe()`` to stop).
        Core subscriptions resume by themselves after a reconnect.
        """

        async def on_msg(msg: Msg) -> None:
            try:
                payload = decode(msg.data)
            except ValueError as exc:
                log.warning("nats_bad_payload", subject=msg.subject, error=str(exc), size=len(msg.data))
                return
            try:
                await handler(msg.subject, payload)
            except Exception as exc:  # a handler bug must not end the subscription
                log.error("nats_handler_failed", subject=msg.subject, error=repr(exc))

        return await self.nc.subscribe(subject, cb=on_msg)

    # -- callbacks: one log line each ---------------------------------------------------------------------

    async def _on_error(self, exc: Exception) -> None:
        self._errors.failed(exc, name=self.name)

    async def _on_disconnected(self) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("nats_disconnected", name=self.name)

    async def _on_reconnected(self) -> None:
        down = time.monotonic() - self._down_since if self._down_since is not None else 0.0
        self._down_since = None
        self._errors.ok()
        url = self._nc.connected_url.geturl() if self._nc and self._nc.connected_url else None
        log.info("nats_reconnected", url=redact(url), outage_s=round(down, 3), name=self.name)
        for listener in list(self._listeners):  # in tasks: nats-py awaits this callback in its reconnect loop
            task = asyncio.create_task(self._run_listener(listener))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _run_listener(listener: ReconnectListener) -> None:
        try:
            result = listener()
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            log.error("nats_reconnect_listener_failed", listener=repr(listener), error=repr(exc))

    async def _on_closed(self) -> None:
        log.info("nats_closed", name=self.name)


async def barrier(nc: Client, timeout_s: float = 10.0) -> None:
    """Return once the server has processed every command ``nc`` sent before (a subscription, a publish).

    ``nc.flush()`` alone is no such barrier: nats-py writes its PING straight to the socket, ahead of the commands
    still in its pending buffer, so the PONG can come back before the server has seen a SUB made just before (a
    publisher on another connection then misses it: measured, about one time in twenty on loopback). The flusher
    task, woken by that first flush, has written the buffer before the PONG is read; a second PING then follows it.
    """
    await nc.flush(timeout_s)  # type: ignore[arg-type]
    await nc.flush(timeout_s)  # type: ignore[arg-type]


async def quietly(awaitable: Awaitable[Any], what: str, timeout_s: float = 2.0) -> None:
    """Await ``awaitable`` for at most ``timeout_s``, logging (at debug) instead of raising: for cleanup paths."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except Exception as exc:  # e.g. closing while the server is gone must not raise into shutdown paths
        log.debug("cleanup_failed", what=what, error=repr(exc))
