"""Admission at the balancer's edge: the fast capacity gate and the request checks both front ends share.

* :class:`AdmissionGate` counts the requests this balancer has admitted and not yet finished against the sum of
  its replicas' capacities (``max_running + max_queued`` of each, learned from their ``GetLoad`` answers and
  refreshed every ``refresh_s``). When every replica is full a request is refused at once, before its body is
  read, tokenized or sent anywhere (HTTP 429 with ``Retry-After``, gRPC RESOURCE_EXHAUSTED). The replica's own
  queue limit stays the authority (several balancers may share a replica); a replica whose capacity is not known
  yet (starting, unreachable, or too old to report it) leaves the gate open.
* :func:`check_request` (before tokenization: cheap field checks) and :func:`check_prompt` (after: lengths,
  the default ``max_tokens``) validate a ``GenerateRequest`` the same way for the gRPC and the HTTP front end;
  they raise a ValueError whose message starts with the field's name (INVALID_ARGUMENT / HTTP 400 with ``param``).
* :func:`served_model_name`: the public name of the model, never a filesystem path.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from deepinfer import envs
from deepinfer.engine.request import validate_request
from deepinfer.rpc.convert import sampling_from_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.serving.errors import Overloaded
from deepinfer.telemetry import get_logger
from deepinfer.v1 import generation_pb2, scheduler_pb2

log = get_logger(__name__)
COMPLETION_MAX_TOKENS = 16  # a completion (text or token ids) without max_tokens: OpenAI's and vLLM's default


class Ticket:
    """One admitted request's place at the gate; ``release()`` (idempotent) gives it back."""

    __slots__ = ("_gate",)

    def __init__(self, gate: AdmissionGate | None) -> None:
        self._gate = gate

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.admitted -= 1


class AdmissionGate:
    """The balancer's own count of admitted requests against its replicas' capacity.

    ``replicas()`` returns the known replicas (objects with ``address`` and a scheduler ``stub``), routable or not:
    a replica that a health probe missed under load (a burst) still counts, so the burst is refused here with 429
    instead of reaching the picker; one really down fails there with 503 while places are left. Capacities are
    learned in the background, so :meth:`admit` never waits on the network."""

    def __init__(self, replicas: Callable[[], Iterable[Any]], refresh_s: float = 5.0, retry_s: float = 1.0) -> None:
        self._replicas, self.refresh_s, self.retry_s = replicas, refresh_s, retry_s
        self.admitted = 0
        self._capacity: dict[str, int] = {}  # address -> max_running + max_queued
        self._asked: dict[str, float] = {}  # address -> when its capacity was last asked for
        self._asking: set[str] = set()  # addresses with a GetLoad in flight
        self._tasks: set[asyncio.Task] = set()

    def capacity(self) -> int | None:
        """The sum of the replicas' capacities; None (not gated) while one of them is unknown or none exists."""
        total, known, now, replicas = 0, True, time.monotonic(), list(self._replicas())
        for r in replicas:
            cap = self._capacity.get(r.address)
            asked = self._asked.get(r.address)
            if asked is None or now - asked > (self.refresh_s if cap is not None else self.retry_s):
                self._learn(r, now)
            if cap is None:
                known = False
            else:
                total += cap
        return total if known and replicas else None

    def admit(self, draining: bool = False) -> Ticket:
        """A place for one request, or Overloaded (RESOURCE_EXHAUSTED / 429) when every replica is full. While
        ``draining`` nothing is counted (the request is refused as UNAVAILABLE / 503 further on)."""
        if draining:
            return Ticket(None)
        cap = self.capacity()
        if cap is not None and self.admitted >= cap:
            raise Overloaded(
                f"every replica is full: {self.admitted} requests in flight, capacity {cap} "
                "(max_running + max_queued of each replica); retry later"
            )
        self.admitted += 1
        return Ticket(self)

    def start(self) -> None:
        """Learn the capacities now and keep them fresh in the background (else only as requests come)."""
        task = asyncio.get_running_loop().create_task(self._refresh_forever())
        self._tasks.add(task)

    async def _refresh_forever(self) -> None:
        while True:
            self.capacity()  # asks the replicas whose capacity is unknown or older than refresh_s
            await asyncio.sleep(self.retry_s)

    def _learn(self, replica: Any, now: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not serving yet
        self._asked[replica.address] = now
        if replica.address in self._asking:
            return
        self._asking.add(replica.address)
        task = loop.create_task(self._ask(replica))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask(self, replica: Any) -> None:
        try:
            load = await replica.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.debug("capacity_unknown", replica=replica.address, code=e.code().name)
            return  # asked again later (a known capacity is kept meanwhile)
        finally:
            self._asking.discard(replica.address)
        if load.max_running > 0:
            self._capacity[replica.address] = load.max_running + max(load.max_queued, 0)
        else:  # a replica that does not report its limits is not gated here
            self._capacity.pop(replica.address, None)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def public_status(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The status a public caller gets for a replica's error. CANCELLED (the replica cancelled the request: it
    stopped or restarted, and the request could not move) becomes UNAVAILABLE, which clients retry; passed on
    as such it would tell the caller that it had cancelled the call itself (and HTTP has no status for it)."""
    details = error.details() or error.code().name
    if error.code() == grpc.StatusCode.CANCELLED:
        return grpc.StatusCode.UNAVAILABLE, f"the replica cancelled the request ({details}); retry"
    return error.code(), details


MAX_SESSION_ID = 256


def check_request(request: generation_pb2.GenerateRequest, max_temperature: float | None = None) -> None:
    """The checks that need no tokenization (run first, so a bad request costs nothing)."""
    if request.WhichOneof("input") == "chat" and not request.chat.messages:
        raise ValueError("chat.messages: at least one message is required")
    if len(request.session_id) > MAX_SESSION_ID:
        raise ValueError(f"session_id: at most {MAX_SESSION_ID} characters (HTTP: user or x-session-id)")
    s = request.sampling
    for name in ("temperature", "top_p"):
        if s.HasField(name) and not math.isfinite(getattr(s, name)):
            raise ValueError(f"{name}: must be a finite number, got {getattr(s, name)}")
    if not math.isfinite(s.min_p):
        raise ValueError(f"min_p: must be a finite number, got {s.min_p}")
    top = envs.DEEPINFER_MAX_TEMPERATURE if max_temperature is None else max_temperature
    if s.HasField("temperature") and s.temperature > top:
        raise ValueError(
            f"temperature: {s.temperature:g} is more than the largest allowed, {top:g} (DEEPINFER_MAX_TEMPERATURE)"
        )


def check_prompt(
    request: generation_pb2.GenerateRequest, ids: list[int], max_model_len: int, vocab_size: int
) -> SamplingParams:
    """The checks against the prompt's length; fills in an absent ``max_tokens`` (in ``request.sampling``, so
    every later submission of the request sees it): a chat gets what the context leaves, at most
    ``DEEPINFER_DEFAULT_MAX_TOKENS``; a completion (text or token ids) OpenAI's 16, at most what the context leaves.
    Returns the engine's parameters."""
    n = len(ids)
    if not n:
        raise ValueError("prompt: empty prompt (at least one token is required)")
    if n >= max_model_len:
        raise ValueError(
            f"prompt: {n} tokens, but the model's context is max_model_len={max_model_len} tokens "
            "(the prompt must leave room for at least one generated token)"
        )
    left, s = max_model_len - n, request.sampling
    if s.HasField("max_tokens"):
        if s.max_tokens > left:
            raise ValueError(
                f"max_tokens: {s.max_tokens} is more than the context leaves after the prompt: "
                f"max_model_len={max_model_len} - {n} prompt tokens = {left}"
            )
    else:
        chat = request.WhichOneof("input") == "chat"
        s.max_tokens = min(left, envs.DEEPINFER_DEFAULT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS)
    params = sampling_from_proto(s)
    validate_request(ids, params, vocab_size)
    return params


def served_model_name(model: str | None, path: Path, explicit: str | None = None) -> str:
    """The name the APIs use for the model: ``explicit`` (``--served-model-name``), else a hub id as given, else
    the model directory's base name (never a filesystem path: it would tell clients about the server's disks)."""
    if explicit:
        return explicit
    given = model if model is not None or envs.DEEPINFER_HF_MODEL_DIR else envs.DEEPINFER_MODEL
    if given and not Path(given).expanduser().is_dir() and not str(given).startswith((".", "/", "~")):
        return str(given)  # a hub id names itself
    return Path(path).resolve().name
