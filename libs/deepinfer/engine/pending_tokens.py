"""Structured-output steps launched before the previous step's tokens reach the host.

A constrained request's next mask depends on the token it sampled last: its matcher must accept that token first.
With async scheduling the next step is launched while the previous one still runs on the device. Holding a
constrained step until the previous one is collected (``Runner.waits_for_tokens``) leaves the device idle while the
host collects, plans and launches: at batch 1 the whole host time of a step. But only the sampler needs the mask; the
forward needs the previous token on the device, which it takes from there (a placeholder, ``ForwardBatch.substitute``)
as every decode row does. So the worker launches the step at once and defers its masks (:class:`DeferredMasks`):
when the sampler asks for them, the forward is queued already; the host waits for the previous step's copy of its
tokens, has each matcher accept its token and fills the masks while the device runs the forward.

:class:`PendingTokens` remembers, per constrained request, the launched step whose token its matcher has not accepted
yet; the early accept marks it in that step (``InFlight.early``) so its collection does not accept it again. A
speculative runner keeps holding the step: its drafting reads the matchers before the forward. So does a step that
installs a request's constraint (its matcher starts from the history the step carries).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

# False: every constrained row with a token in flight holds its step, as before (the A/B of
# bench/engine/structured_outputs.py; a planted regression in tests)
EARLY = True


class PendingTokens:
    """Per constrained request, the launched step holding the token its matcher is still to accept."""

    def __init__(self) -> None:
        self.steps: dict[str, Any] = {}  # request id -> its InFlight step (``engine.worker``)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.steps

    def sampled(self, step: Any, request_ids: Sequence[str], constraints: Any) -> None:
        """``step`` sampled a token for each of ``request_ids``: the constrained ones wait for its accept."""
        for rid in request_ids:
            if rid in constraints:
                self.steps[rid] = step

    def collected(self, step: Any, request_id: str) -> bool:
        """``step`` is collected: whether its token for ``request_id`` is still to be accepted (not done early)."""
        if self.steps.get(request_id) is step:
            del self.steps[request_id]
        return request_id not in step.early

    def accept(self, request_ids: Sequence[str], constraints: Any) -> None:
        """Each of ``request_ids`` with a pending token: wait for its step's copy to the host, accept the token."""
        tokens: dict[int, dict[str, int]] = {}  # per step (by id): its tokens by request, read from the host once
        for rid in request_ids:
            step = self.steps.pop(rid, None)
            if step is None:
                continue
            if id(step) not in tokens:
                if step.event is not None:
                    step.event.synchronize()
                tokens[id(step)] = dict(zip(step.rids, step.host[: len(step.rids)].tolist()))
            constraints.accept(rid, int(tokens[id(step)][rid]))
            step.early.add(rid)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.steps.pop(rid, None)


class DeferredMasks:
    """``Future``'s ``result()`` for the masks of ``request_ids``: their pending tokens accepted first, then the masks
    filled on this thread (once; the sampler calls it with the step's forward queued)."""

    def __init__(self, pending: PendingTokens, constraints: Any, request_ids: Sequence[str]) -> None:
        self.pending, self.constraints, self.request_ids = pending, constraints, list(request_ids)
        self._masks: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self._masks is None:
            self.pending.accept(self.request_ids, self.constraints)
            self._masks = self.constraints.fill(self.request_ids)
        return self._masks


def start_masks(runner: Any, plan: Any, pre: dict[str, torch.Tensor]) -> tuple | None:
    """Install the constraints that arrive with ``plan``; start filling the masks of its constrained rows: in the
    constraint set's thread while the device runs the forward, or deferred to the sampler where a row's last token
    is still to be accepted (module docstring). ``pre``: the verify rows' masks, filled already
    (``engine.speculative.grammar``). Returns what ``speculative.grammar.row_masks`` takes, or None."""
    cs = runner.constraints
    for c in plan.chunks:
        if c.constraint is not None:
            if cs is None:
                raise RuntimeError(f"request {c.request_id}: this worker applies no structured-output constraints")
            cs.install(c.request_id, c.constraint, c.constraint_history or ())
    rids = [c.request_id for c in plan.chunks if c.sample and cs is not None and c.request_id in cs]
    rids = [rid for rid in rids if rid not in pre]
    if not rids:
        return ([], None, pre) if pre else None
    late = any(rid in runner.pending for rid in rids)
    masks: Future | DeferredMasks = DeferredMasks(runner.pending, cs, rids) if late else cs.fill_async(rids)
    return rids, masks, pre


def waits_for_tokens(runner: Any, plan: Any) -> bool:
    """Whether ``plan`` must wait for the steps in flight: a row of a constrained request whose last token is still
    on the device, where the step installs the constraint, the runner drafts speculatively, or no launched step
    holds that token for an early accept."""
    cs = runner.constraints
    for c in plan.chunks:
        if not isinstance(runner.sampled.get(c.request_id), tuple):
            continue
        if c.constraint is not None:
            return True
        held = runner.spec is not None or not EARLY or c.request_id not in runner.pending
        if cs is not None and c.request_id in cs and held:
            return True
    return False


__all__ = ["DeferredMasks", "PendingTokens", "start_masks", "waits_for_tokens"]
