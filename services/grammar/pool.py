"""Compiling in child processes, so that no grammar can stall or crash the process that asked for it.

:class:`CompilerPool` keeps ``workers`` processes (``python -m services.grammar.child``: line-delimited JSON on
stdin/stdout, never pickle), each with its private memory capped (``RLIMIT_DATA``) and each compiling one
grammar at a time. A request is checked against the limits here first (refusals never reach a child), then
looked up in the cache (byte-capped LRU, keyed by :func:`~deepinfer.grammar.spec.cache_key` like the
in-process :class:`~deepinfer.grammar.compiler.Compiler`), then sent to an idle child. Concurrent requests
for the same grammar share one compile. The outcomes:

* past its time limit the child is killed (xgrammar cannot cancel) → :class:`GrammarTimeout`;
* the child dies (a crash in xgrammar) or runs out of memory → :class:`GrammarError` (outcome ``crash``);
* either way a new child replaces it in the background, and the other children keep serving;
* no child can start (e.g. a memory cap below what loading xgrammar needs) → :class:`GrammarUnavailable`.

With ``DEEPINFER_GRAMMAR_BACKEND=auto`` a ``json_schema`` or ``regex`` whose xgrammar compile runs past
:data:`AUTO_XGRAMMAR_SHARE` of the time limit is compiled again with llguidance, in another child, within
what is left of the limit: the total stays bounded by the limit, and only if llguidance fails too is it a
:class:`GrammarTimeout` (or llguidance's refusal).

A caller that gives up (cancellation) does not stop a compile that a child has begun: it finishes within
its time limit and its result is cached, so a retry is a cache hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepinfer import envs
from deepinfer.grammar.cache import GrammarCache
from deepinfer.grammar.compiler import backend_for, check_backend, compile_options
from deepinfer.grammar.limits import Limits, inspect_spec
from deepinfer.grammar.llg import llg_reason
from deepinfer.grammar.spec import (
    KINDS,
    CompiledGrammar,
    GrammarError,
    GrammarSpec,
    GrammarTimeout,
    GrammarUnavailable,
    cache_key,
)
from deepinfer.grammar.vocab import tokenizer_fingerprint
from deepinfer.telemetry import get_logger
from services.grammar.process import CompileProcess, ProcessDied

__all__ = ["AUTO_XGRAMMAR_SHARE", "CompilerPool"]

log = get_logger(__name__)
_INLINE_CHECK_CHARS = 64 * 1024
AUTO_XGRAMMAR_SHARE = 0.75  # auto: the share of the time limit xgrammar gets; llguidance gets the rest
_PASS_MODE = {"xgrammar": "raise", "auto": "keep", "llguidance": "skip"}


@dataclass(eq=False)
class _Job:
    task: asyncio.Task | None = None
    waiters: int = 0
    started: bool = False


@dataclass
class _Config:
    model_dir: str | None
    memory_bytes: int
    json_whitespace: int
    limits: dict = field(default_factory=dict)
    parent_pid: int = 0
    json_indent: int = 0
    backend: str = "xgrammar"


class CompilerPool:
    """``workers`` compile processes behind an LRU cache; all settings default to ``DEEPINFER_GRAMMAR_*``.

    Use from one event loop: ``await pool.start()`` (optional: the first compile starts it),
    ``grammar, cached = await pool.compile(spec, timeout_s)``, ``await pool.close()``.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        workers: int | None = None,
        timeout_s: float | None = None,
        memory_bytes: int | None = None,
        cache_bytes: int | None = None,
        limits: Limits | None = None,
        json_whitespace: int | None = None,
        start_timeout_s: float = 120.0,
        on_restart: Callable[[str], None] | None = None,
        json_indent: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.model_dir = str(model_dir) if model_dir is not None else None
        self.workers = envs.DEEPINFER_GRAMMAR_WORKERS if workers is None else int(workers)
        self.timeout_s = envs.DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self.limits = limits if limits is not None else Limits.from_env()
        ws = envs.DEEPINFER_GRAMMAR_JSON_WHITESPACE if json_whitespace is None else int(json_whitespace)
        memory = envs.DEEPINFER_GRAMMAR_MEMORY_BYTES if memory_bytes is None else int(memory_bytes)
        indent = envs.DEEPINFER_GRAMMAR_JSON_INDENT if json_indent is None else int(json_indent)
        self.backend = check_backend(envs.DEEPINFER_GRAMMAR_BACKEND if backend is None else backend, indent)
        self._config = _Config(self.model_dir, memory, ws, asdict(self.limits), os.getpid(), indent, self.backend)
        self.options = compile_options(ws, indent, self.backend)
        self.cache = GrammarCache(envs.DEEPINFER_GRAMMAR_CACHE_BYTES if cache_bytes is None else cache_bytes)
        self.tokenizer_fingerprint = tokenizer_fingerprint(model_dir)
        self.start_timeout_s = start_timeout_s
        self.on_restart = on_restart
        self._children: set[CompileProcess] = set()
        self._idle: asyncio.Queue[CompileProcess] | None = None
        self._jobs: dict[str, _Job] = {}
        self._spawners: set[asyncio.Task] = set()
        self._broken: asyncio.Event | None = None
        self._start_lock: asyncio.Lock | None = None
        self._started = self._closed = False
        self.last_start_error = ""
        self._next_id = 0

    # -- state, for metrics and health --
    @property
    def alive(self) -> int:
        return sum(1 for c in self._children if c.alive())

    @property
    def idle(self) -> int:
        return self._idle.qsize() if self._idle is not None else 0

    def key(self, spec: GrammarSpec) -> str:
        return cache_key(self.tokenizer_fingerprint, spec.kind, spec.text, self.options)

    # -- lifecycle --
    async def start(self) -> None:
        """Start the children and wait until they are ready; :class:`GrammarUnavailable` if none can start."""
        if self._start_lock is None:
            self._start_lock, self._idle, self._broken = asyncio.Lock(), asyncio.Queue(), asyncio.Event()
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise GrammarUnavailable("the grammar compiler pool is closed")
            launched = await asyncio.gather(*(self._launch() for _ in range(self.workers)), return_exceptions=True)
            failed = [r for r in launched if isinstance(r, BaseException)]
            if len(failed) == len(launched):
                raise GrammarUnavailable(f"no grammar compile process could start: {failed[0]}")
            for result in launched:
                if isinstance(result, CompileProcess):
                    self._ready(result)
                else:
                    self._respawn(f"start failed: {result}")
            self._started = True
            log.info("grammar_pool_started", workers=self.workers, timeout_s=self.timeout_s,
                     memory_bytes=self._config.memory_bytes, cache_bytes=self.cache.capacity_bytes)  # fmt: skip

    async def close(self) -> None:
        """Stop every child and background task; pending compiles fail with :class:`GrammarUnavailable`."""
        self._closed = True
        tasks = [*self._spawners, *(j.task for j in self._jobs.values() if j.task is not None)]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        await asyncio.gather(*(c.kill() for c in list(self._children)), return_exceptions=True)
        self._children.clear()

    async def _launch(self) -> CompileProcess:
        child = await CompileProcess.spawn(asdict(self._config))
        self._children.add(child)  # counted (and killed by close) while it starts
        try:
            await child.wait_ready(self.start_timeout_s, self._config.memory_bytes)
        except BaseException:
            self._children.discard(child)
            raise
        return child

    def _ready(self, child: CompileProcess) -> None:
        assert self._idle is not None and self._broken is not None
        self._broken.clear()
        self._idle.put_nowait(child)

    def _respawn(self, reason: str) -> None:
        if self._closed:
            return
        if self.on_restart is not None:
            self.on_restart(reason.split(":")[0])
        task = asyncio.create_task(self._spawn_until_ready(), name="grammar-respawn")
        self._spawners.add(task)
        task.add_done_callback(self._spawners.discard)

    async def _spawn_until_ready(self) -> None:
        delay = 0.5
        while not self._closed:
            try:
                child = await self._launch()
            except GrammarUnavailable as e:
                self.last_start_error = str(e)
                log.error("grammar_process_start_failed", error=str(e), retry_in_s=delay)
                if self.alive == 0 and self._broken is not None:
                    self._broken.set()  # waiting compiles fail fast instead of waiting for a child
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self._ready(child)
            return

    async def _replace(self, child: CompileProcess, reason: str) -> None:
        self._children.discard(child)
        log.warning("grammar_process_replaced", pid=child.pid, reason=reason)
        self._respawn(reason)
        await child.kill()

    # -- compiling --
    def route(self, kind: str) -> str:
        """The engine that compiles a ``kind`` here: xgrammar, llguidance, or auto (xgrammar, then llguidance)."""
        return backend_for(kind, self.backend, self._config.json_indent) if kind in KINDS else self.backend

    async def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> tuple[CompiledGrammar, bool]:
        """The compiled grammar and whether it came from the cache. Raises :class:`GrammarError` (invalid,
        over a limit, crashed; :class:`GrammarTimeout` past ``timeout_s``) or :class:`GrammarUnavailable`."""
        if self._closed:
            raise GrammarUnavailable("the grammar compiler pool is closed")
        if spec.kind in KINDS and isinstance(spec.text, str):
            hit = self.cache.get(self.key(spec))
            if hit is not None:
                return hit, True
        mode = _PASS_MODE[backend_for(spec.kind, self.backend, self._config.json_indent)]
        if isinstance(spec.text, str) and len(spec.text) > _INLINE_CHECK_CHARS:  # ~80 ms per MB: off the loop
            await asyncio.to_thread(inspect_spec, spec, self.limits, mode)
        else:
            inspect_spec(spec, self.limits, mode)
        if not self._started:
            await self.start()
        key = self.key(spec)
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job()
            limit = timeout_s if timeout_s is not None and timeout_s > 0 else self.timeout_s
            job.task = asyncio.create_task(self._run_routed(job, spec, key, limit))
            job.task.add_done_callback(lambda t, k=key, j=job: self._finished(k, j, t))
        job.waiters += 1
        try:
            return await asyncio.shield(job.task), False
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if job.task.cancelled() and not (current is not None and current.cancelling()):
                raise GrammarUnavailable("the grammar compiler pool was closed") from None
            raise
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.started and not job.task.done():
                job.task.cancel()  # nobody waits and no child has begun: drop it

    def _finished(self, key: str, job: _Job, task: asyncio.Task) -> None:
        if self._jobs.get(key) is job:
            del self._jobs[key]
        if not task.cancelled():
            task.exception()  # retrieved: a compile nobody waits for any more is not an unhandled error

    async def _take_child(self) -> CompileProcess:
        assert self._idle is not None and self._broken is not None
        while True:
            if self._idle.empty():
                if self._broken.is_set() and self.alive == 0:
                    raise GrammarUnavailable(f"no grammar compile process is running: {self.last_start_error}")
                getter = asyncio.ensure_future(self._idle.get())
                try:
                    done, _ = await asyncio.wait({getter}, timeout=0.5)  # then look at the processes again
                except BaseException:
                    if getter.done() and not getter.cancelled():
                        self._idle.put_nowait(getter.result())  # cancelled after taking one: give it back
                    getter.cancel()
                    raise
                if not done:
                    getter.cancel()  # Queue.get leaves an item it was woken for to the next getter
                    continue
                child = getter.result()
            else:
                child = self._idle.get_nowait()
            if child.alive():
                return child
            await self._replace(child, "crash: died while idle")

    async def _run_routed(self, job: _Job, spec: GrammarSpec, key: str, timeout_s: float) -> CompiledGrammar:
        """:meth:`_run`; under ``auto``, past its share of the time an xgrammar compile gives way to llguidance."""
        if backend_for(spec.kind, self.backend, self._config.json_indent) != "auto":
            return await self._run(job, spec, key, timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            return await self._run(job, spec, key, timeout_s * AUTO_XGRAMMAR_SHARE)
        except GrammarTimeout as first:
            left = deadline - loop.time()
            log.info("grammar_auto_fallback", kind=spec.kind, reason="xgrammar timeout", left_s=round(left, 3))
            try:
                return await asyncio.wait_for(self._run(job, spec, key, left, "llguidance"), max(left, 0.001))
            except TimeoutError:
                raise GrammarTimeout(f"{first} (then llguidance did not finish within the {timeout_s:g} s)") from None
            except GrammarTimeout as second:
                raise GrammarTimeout(f"{first} (then llguidance: {second})") from None
            except GrammarError as second:
                why = llg_reason(second)
                raise GrammarError(f"{first}, and llguidance refuses it: {why}", second.outcome) from None

    async def _run(
        self, job: _Job, spec: GrammarSpec, key: str, timeout_s: float, backend: str | None = None
    ) -> CompiledGrammar:
        child = await self._take_child()
        job.started = True
        self._next_id += 1
        message = {"id": self._next_id, "kind": spec.kind, "text": spec.text}
        if backend is not None:
            message["backend"] = backend
        try:
            reply = await child.request(message, timeout_s)
        except TimeoutError:
            await self._replace(child, "timeout")
            raise GrammarTimeout(
                f"{spec.kind}: compile timed out after {timeout_s:g} s (the limit: DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S "
                "or the request's timeout)"
            ) from None
        except ProcessDied as e:
            await self._replace(child, f"crash: {e}")
            raise GrammarError(f"{spec.kind}: the grammar compiler crashed on this grammar ({e})", "crash") from None
        except BaseException:
            await self._replace(child, "cancelled")
            raise
        if reply.get("fatal"):
            await self._replace(child, f"crash: {reply.get('error')}")
        else:
            self._idle.put_nowait(child)  # type: ignore[union-attr]
        if not reply.get("ok"):
            error = str(reply.get("error"))
            if "out of memory" in error:
                cap = self._config.memory_bytes
                error += f" (the compile processes' cap is {cap} bytes, DEEPINFER_GRAMMAR_MEMORY_BYTES)"
            raise GrammarError(error, str(reply.get("outcome") or "invalid"))
        controls, backend = tuple(reply["allowed_control_token_ids"]), str(reply.get("backend") or "xgrammar")
        grammar = CompiledGrammar(reply["compiled_json"], key, self.tokenizer_fingerprint, controls, backend)
        if reply.get("cache_key") != key:
            raise GrammarUnavailable("a compile process uses other settings than the pool (cache key mismatch)")
        self.cache.put(grammar)
        return grammar
