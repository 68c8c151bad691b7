"""Structured-output constraints on the worker: one matcher per constrained request — xgrammar's, or
llguidance's (:mod:`deepinfer.engine.llg_matcher`) for a grammar whose ``backend`` is ``llguidance``; both fill
the same packed mask layout, so requests of either backend share a batch, each filling its own row.

A :class:`Constraint` arrives with a request's first chunk (and again, with the tokens generated so far,
after a preemption). For every sampling row of a constrained request the worker asks
:meth:`ConstraintSet.fill` for the allowed-token mask — started in a thread before the step's forward, so
the CPU fills it while the device computes — and the sampler picks among the allowed tokens only (the
reported logprobs stay the raw model's). The sampled token then advances the matcher (:meth:`accept`);
:meth:`rollback` takes back the last ``k`` tokens (speculative decoding's rejected drafts).

What a row may sample:
* grammar active: what the grammar allows next (EOS only where the grammar may end), minus the control
  tokens (think tags, DSML, tool-call markers) the grammar does not name, minus ``banned_token_ids``;
* thinking mode (``after_think``) before the first ``</think>``: anything except EOS, the banned tokens and
  the reasoning-banned ones (the constrained answer is still to come);
* the grammar terminated (a row the async pipeline scheduled after the final EOS): EOS only.

A request whose grammar fails on the worker — a grammar it cannot load (compiled for another tokenizer,
damaged), a matcher that errs (llguidance over its parser limits) or a sampled token the grammar refuses — is
held to EOS only and :meth:`ConstraintSet.failure` says why; the worker reports that reason with the request's
result (``SeqResult.error``) and the request ends with finish reason ``error``, never a silent ``stop``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.constraint import Constraint
from deepinfer.engine.token_masks import Refusal, pack
from deepinfer.runtime.host_copy import to_device
from deepinfer.telemetry import get_logger

log = get_logger(__name__)
_BITS = torch.arange(32, dtype=torch.int32)
# per accepted token: before "</think>"; accepted by the grammar; the "</think>" that opened it; refused
_UNSEEN, _SEEN, _OPENED, _REFUSED = 0, 1, 2, 3
FILL_THREADS = 8  # the most threads xgrammar's batch fill uses (and at most half the host's cores)


@dataclass
class _Matcher:
    constraint: Constraint
    matcher: Any  # xgrammar.GrammarMatcher or an LlgMatcher, or None without a grammar
    forbidden: Refusal  # the tokens masked whenever the grammar is active
    before: Refusal  # the tokens masked before "</think>" (EOS, the banned ones)
    active: bool  # the grammar applies (False before "</think>" in thinking mode)
    accepted: deque[int]  # the last accepted tokens (as many as may roll back): _UNSEEN, _SEEN, _OPENED, _REFUSED
    refused: int = 0  # tokens the grammar refused but were accepted anyway (a worker bug): EOS only from here
    error: str | None = None  # the grammar failed for good (not loaded, the matcher erred): EOS only, reported
    refused_why: str = ""  # why the last refused token was refused

    @property
    def broken(self) -> bool:
        return self.refused > 0 or self.error is not None

    def failure(self) -> str | None:
        """Why this request's grammar cannot be enforced any more (None: it can)."""
        return self.error or (self.refused_why if self.refused > 0 else None)


class ConstraintSet:
    """The matchers of one worker's constrained requests, keyed by request id."""

    def __init__(
        self,
        tokenizer_info: Callable[[], Any],
        control_ids: dict[int, str],
        vocab_size: int,
        eos_token_id: int,
        think_end_id: int | None,
        tokenizer_fingerprint: str = "",
        max_rollback: int = 16,
        cache_size: int = 64,
        llg_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        self._tokenizer_info, self._info = tokenizer_info, None
        self._llg_tokenizer, self._llg = llg_tokenizer, None  # llguidance's LLTokenizer (built on first use)
        self.control_ids, self.vocab_size, self.eos = control_ids, vocab_size, eos_token_id
        self.think_end, self.fingerprint, self.max_rollback = think_end_id, tokenizer_fingerprint, max_rollback
        self.matchers: dict[str, _Matcher] = {}
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # deserialized grammars (llguidance: templates)
        self._cache_size = cache_size
        self._pool: ThreadPoolExecutor | None = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher (its thread pool), made on first use
        self._lock, self._info_lock = threading.Lock(), threading.Lock()
        self._eos_only = pack([eos_token_id], vocab_size)
        # one per token set, the requests that share it sharing it; the sets come with requests (banned ids), so the
        # least recently installed go past ``cache_size`` (their matchers keep theirs: rows of one set then update
        # apart, no less right)
        self._refusals: OrderedDict[tuple[int, ...], Refusal] = OrderedDict()

    # -- requests ---------------------------------------------------------------------------
    def install(self, request_id: str, constraint: Constraint, history: Sequence[int] = ()) -> None:
        """Start enforcing ``constraint`` on ``request_id``; ``history`` are tokens it already generated.

        A grammar this worker cannot load (another tokenizer, a damaged text) is logged, the request is held
        to EOS only and :meth:`failure` gives the reason (it ends with an error); nothing else in the step is
        affected."""
        g, matcher, error = constraint.grammar, None, None
        if g is not None:
            try:
                matcher = self._matcher(g)
            except ValueError as e:
                log.error("constraint_refused", request_id=request_id, error=str(e))
                error = str(e)
        # under a grammar the control tokens it does not name are masked; without one, only the banned tokens
        named = set(g.allowed_control_token_ids) if g is not None else set(self.control_ids)
        forbidden = {t for t in self.control_ids if t not in named} | set(constraint.banned_token_ids)
        before = {self.eos, *constraint.banned_token_ids, *constraint.reasoning_banned_token_ids}
        m = _Matcher(
            constraint,
            matcher,
            self._refusal(forbidden),
            self._refusal(before),
            active=not constraint.after_think or error is not None,
            accepted=deque(maxlen=self.max_rollback),
            error=error,
        )
        with self._lock:
            self.matchers[request_id] = m
        for t in history:
            self._accept(m, t)

    def release(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self.matchers.pop(rid, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.matchers

    def failure(self, request_id: str) -> str | None:
        """Why ``request_id``'s grammar cannot be enforced (it was not loaded, its matcher erred, or it refused
        a sampled token): the request must end with an error. None: it is enforced (or not constrained)."""
        m = self.matchers.get(request_id)
        return None if m is None else m.failure()

    def accept(self, request_id: str, token_id: int) -> None:
        m = self.matchers.get(request_id)
        if m is not None:
            self._accept(m, token_id)

    def rollback(self, request_id: str, k: int) -> None:
        """Take back the last ``k`` accepted tokens (at most ``max_rollback``)."""
        m = self.matchers[request_id]
        if not 0 <= k <= min(len(m.accepted), self.max_rollback):
            raise ValueError(f"rollback: {k} tokens (accepted {len(m.accepted)}, limit {self.max_rollback})")
        undo = [m.accepted.pop() for _ in range(k)]
        m.refused -= undo.count(_REFUSED)
        seen = undo.count(_SEEN)
        if seen and m.matcher is not None:
            m.matcher.rollback(seen)
        if _OPENED in undo:
            m.active = False

    # -- masks ------------------------------------------------------------------------------
    def fill_async(self, request_ids: Sequence[str]) -> Future:
        """:meth:`fill` in a background thread (one per worker; its result is read before sampling)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._pool.submit(self.fill, list(request_ids))

    def fill(self, request_ids: Sequence[str]) -> torch.Tensor:
        """Packed allowed-token masks ``[n, ceil(V/32)]`` int32 (bit ``t % 32`` of word ``t // 32``), one
        row per request id (a request without a constraint allows everything)."""
        words = -(-self.vocab_size // 32)
        bitmask = torch.full((len(request_ids), words), -1, dtype=torch.int32)
        grammar_rows = []  # (row, request id, matcher) whose grammar fills the row
        eos_only: list[int] = []
        refused: dict[Refusal, list[int]] = {}  # the rows that refuse each token set besides their grammar's
        for i, rid in enumerate(request_ids):
            m = self.matchers.get(rid)
            if m is None:
                continue
            if m.broken or (m.matcher is not None and m.active and m.matcher.is_terminated()):
                eos_only.append(i)
            elif not m.active:
                refused.setdefault(m.before, []).append(i)
            elif m.matcher is not None:
                grammar_rows.append((i, rid, m))
            else:
                refused.setdefault(m.forbidden, []).append(i)
        self._fill_rows(grammar_rows, bitmask)
        for i, _, m in grammar_rows:
            if not m.broken:  # (a matcher that failed filling its row left it EOS only)
                refused.setdefault(m.forbidden, []).append(i)
        if eos_only:
            bitmask[eos_only] = self._eos_only
        for refusal, rows in refused.items():  # one indexed update per token set, not one per row
            refusal.clear(bitmask, rows)
        return bitmask

    def _fill_rows(self, rows: list[tuple[int, str, _Matcher]], bitmask: torch.Tensor) -> None:
        """The grammars' rows: xgrammar's matchers, two or more, in one call on its thread pool (at batch 64 one
        request after another took 2.4 ms of the step on an H100 host, on the critical path of a constrained
        step); the rest, and all of them if that call fails, one by one (``_fill``)."""
        import xgrammar as xgr

        batch = [(i, rid, m) for i, rid, m in rows if isinstance(m.matcher, xgr.GrammarMatcher)]
        done: set[int] = set()
        if len(batch) >= 2:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max(1, min(FILL_THREADS, (os.cpu_count() or 2) // 2)))
            try:
                self._batch.batch_fill_next_token_bitmask([m.matcher for _, _, m in batch], bitmask,
                                                          [i for i, _, _ in batch])  # fmt: skip
                done = {i for i, _, _ in batch}
            except Exception as e:  # noqa: BLE001 - one by one instead: each matcher's failure is its own request's
                log.warning("grammar_batch_fill_failed", error=f"{type(e).__name__}: {e}")
        for i, rid, m in rows:
            if i not in done:
                self._fill(m, rid, bitmask, i)

    def _fill(self, m: _Matcher, rid: str, bitmask: torch.Tensor, i: int) -> None:
        """The matcher's row; a matcher that fails (llguidance past its parser limits) fails its request."""
        try:
            m.matcher.fill_next_token_bitmask(bitmask, i)
            err = _matcher_error(m.matcher)
        except Exception as e:  # noqa: BLE001 - a matcher's failure must fail its request, not the step
            err = f"{type(e).__name__}: {e}"
        if err is not None:
            log.error("grammar_matcher_error", request_id=rid, error=err)
            m.error = f"constraint.grammar: the grammar matcher failed: {err}"
            bitmask[i] = self._eos_only

    @staticmethod
    def allowed(bitmask: torch.Tensor, vocab: int, device: torch.device | str) -> torch.Tensor:
        """Unpack ``bitmask`` to a bool ``[n, vocab]`` on ``device`` (columns past the mask: refused)."""
        b = to_device(bitmask, device)
        bits = (b.unsqueeze(-1) >> _BITS.to(device)) & 1
        flat = bits.flatten(1).bool()
        if flat.shape[1] >= vocab:
            return flat[:, :vocab]
        return torch.cat([flat, flat.new_zeros(flat.shape[0], vocab - flat.shape[1])], dim=1)

    def apply(self, logits: torch.Tensor, packed: torch.Tensor, rows: Sequence[int]) -> None:
        """Set to ``-inf``, in place, the logits of ``rows`` whose tokens ``packed`` (one mask row per entry of
        ``rows``, from :meth:`fill`) refuses; columns past the masks' vocabulary are refused too."""
        import xgrammar as xgr

        if not rows:
            return
        words = packed.shape[1]
        every = len(rows) == logits.shape[0] and list(rows) == list(range(len(rows)))  # (each row, in order)
        if every:
            full = packed
        else:
            full = torch.full((logits.shape[0], words), -1, dtype=torch.int32)
            full[list(rows)] = packed
        from deepinfer.runtime.platform import platform_of

        host, triton = logits.device.type == "cpu", platform_of(logits.device).triton
        backend = "cpu" if host else "auto" if triton else "torch_native"  # xgrammar's kernels: Triton's or torch's
        vocab = min(self.vocab_size, logits.shape[-1])
        # the masks and the row indices reach the device without the host waiting for it (``to_device``): a plain
        # ``.to(device)`` (and xgrammar's copy of an index list) waits for the forward queued ahead, which would
        # cost a served step its overlap with the host (``engine.pending_tokens``)
        if every:
            index = None
        else:
            index = list(rows) if host else to_device(torch.tensor(list(rows), dtype=torch.int32), logits.device)
        xgr.apply_token_bitmask_inplace(
            logits, to_device(full, logits.device), vocab_size=vocab, indices=index, backend=backend
        )
        if logits.shape[-1] > vocab:
            logits[slice(None) if index is None else index if host else index.long(), vocab:] = float("-inf")

    # -- internals --------------------------------------------------------------------------
    def _refusal(self, ids: set[int]) -> Refusal:
        key = tuple(sorted(ids))
        with self._lock:
            if key not in self._refusals:
                self._refusals[key] = Refusal.of(key, self.vocab_size)
                while len(self._refusals) > self._cache_size:
                    self._refusals.popitem(last=False)
            self._refusals.move_to_end(key)
            return self._refusals[key]

    def warm(self) -> None:
        """Build the tokenizer's grammar view now (about a second) rather than at the first constrained request."""
        self._info_()

    def _info_(self) -> Any:
        with self._info_lock:
            if self._info is None:
                self._info = self._tokenizer_info()
            return self._info

    def _llg_tokenizer_(self) -> Any:
        with self._info_lock:
            if self._llg is None:
                if self._llg_tokenizer is None:
                    raise ValueError("constraint.grammar: an llguidance grammar, and this worker has no llguidance")
                self._llg = self._llg_tokenizer()
            return self._llg

    def _matcher(self, g: Any) -> Any:
        import xgrammar as xgr

        if self.fingerprint and g.tokenizer_fingerprint and g.tokenizer_fingerprint != self.fingerprint:
            raise ValueError(
                f"constraint.grammar: compiled for tokenizer {g.tokenizer_fingerprint[:12]}, this worker uses "
                f"{self.fingerprint[:12]}"
            )
        backend = getattr(g, "backend", "xgrammar") or "xgrammar"
        if backend == "llguidance":
            from deepinfer.engine.llg_matcher import LlgMatcher

            return LlgMatcher(self._grammar(g, backend), self.eos, self.vocab_size)
        if backend != "xgrammar":
            raise ValueError(f"constraint.grammar: unknown grammar backend {backend!r}")
        return xgr.GrammarMatcher(self._grammar(g, backend))  # rollback is unlimited in xgrammar >= 0.2

    def _load(self, g: Any, backend: str) -> Any:
        if backend == "llguidance":
            from deepinfer.engine.llg_matcher import llg_template

            return llg_template(self._llg_tokenizer_(), g.compiled_json)
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(g.compiled_json, self._info_())

    def _grammar(self, g: Any, backend: str) -> Any:
        key = f"{backend}:{g.cache_key}" if g.cache_key else ""
        compiled = self._compiled.get(key) if key else None
        if compiled is None:
            try:
                compiled = self._load(g, backend)
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar and llguidance raise their own error types
                raise ValueError(f"constraint.grammar: cannot load the compiled grammar: {e}") from None
            if key:
                self._compiled[key] = compiled
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled

    def _accept(self, m: _Matcher, token: int) -> None:
        if not m.active:
            opens = token == self.think_end
            m.accepted.append(_OPENED if opens else _UNSEEN)
            m.active = opens
            return
        if m.matcher is None:
            m.accepted.append(_SEEN)
        elif token == self.eos and not m.broken and m.matcher.is_terminated():
            m.accepted.append(_UNSEEN)  # EOS again after the end (ignore_eos, min_tokens): what the mask allows
        elif m.broken or m.matcher.is_terminated() or not m.matcher.accept_token(int(token)):
            # with the mask applied only a failed matcher (or a worker bug) gets here: the request fails
            err = _matcher_error(m.matcher)
            log.warning("grammar_refused_token", token_id=int(token), error=err)
            m.accepted.append(_REFUSED)
            m.refused += 1
            if m.error is None and err is not None:
                m.error = f"constraint.grammar: the grammar matcher failed: {err}"
            m.refused_why = f"constraint.grammar: the grammar refused the sampled token {int(token)}"
        else:
            m.accepted.append(_SEEN)


def _matcher_error(matcher: Any) -> str | None:
    """The error a matcher is in (an llguidance matcher's; xgrammar's have none), or None."""
    error = getattr(matcher, "error", None)
    return error() if callable(error) else None
