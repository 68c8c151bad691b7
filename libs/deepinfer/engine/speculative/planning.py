"""The scheduler's side of speculative decoding: whether a step may verify drafts, and how many a row may verify.

A verify step costs more than a plain decode step (drafts + 1 rows per sequence); at a large batch the plain step
is no longer bound by the weights' bytes and the rows the drafts add are not free, so above
``SchedulerConfig.spec_max_batch`` decode rows the step runs without drafts (``SpecStats.steps_off_batch``). Under
the limit the measured cost per token decides (``engine.speculative.policy``; ``SpecStats.steps_off_cost``). Both
are exported as ``deepinfer_spec_decode_steps_off{reason}``.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.engine.interfaces import WorkerStepPlan
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.engine.speculative.policy import SpecPolicy
from deepinfer.engine.speculative.stats import SpecStats


def speculating(config: SchedulerConfig, running: Iterable[Request], stats: SpecStats, policy: SpecPolicy) -> bool:
    """Whether this step may verify drafts: the worker drafts, the decode rows are few enough, and drafting was
    measured to cost less per token at this batch (or is being measured)."""
    if not config.num_speculative_tokens:
        return False
    policy.chosen = None  # (set by ``choose``: the step then counts towards the policy's burst or exploration)
    rows = sum(1 for r in running if r.in_flight or r.num_tokens - r.num_computed == 1)
    if rows > config.spec_max_batch:
        stats.steps_off_batch += 1
        return False
    if rows and not policy.choose(rows):
        stats.steps_off_cost += 1
        return False
    return True


def track(policy: SpecPolicy, plan: WorkerStepPlan) -> None:
    """Tell the policy a step was sent (its decode rows, whether it drafts, whether it is decode rows alone)."""
    if not plan.chunks:
        return
    decode = [c for c in plan.chunks if c.sample and len(c.token_ids) == 1]
    drafted = any(c.num_drafts for c in plan.chunks)
    policy.planned(plan.step_id, len(decode), drafted, len(decode) == len(plan.chunks))


def draftable(config: SchedulerConfig, req: Request, max_len: int) -> int:
    """Drafts a decode row may verify: none past its ``max_tokens`` or the length limit ``max_len`` (a verify step
    emits up to drafts + 1 tokens). A structured-output request drafts too: the worker keeps the drafts its grammar
    allows (``engine.speculative.grammar``)."""
    n = config.num_speculative_tokens
    if req.params.max_tokens is not None:
        n = min(n, req.params.max_tokens - len(req.output_token_ids) - 1)
    return max(0, min(n, max_len - req.num_tokens - 1))


__all__ = ["draftable", "speculating", "track"]
