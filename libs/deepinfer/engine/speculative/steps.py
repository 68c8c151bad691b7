"""Speculative decoding inside the runner's step (``engine.worker.ModelRunner``): which chunks verify drafts, the
forward, and the verdict.

The scheduler marks a decode chunk with ``num_drafts`` (``ChunkPlan``) when it gives it the pages for that many more
positions. At launch the model family's :class:`Speculator` proposes up to that many drafts per chunk; the chunk
then runs its token and its drafts (a ragged step: eager, or piecewise CUDA graphs), every row is sampled as a plain
step would sample that position (``engine.speculative.acceptance``), and the step settles before it returns: the
samples come to the host, each chunk keeps its leading drafts that equal the samples, the speculator rolls the
rejected rows back (bit-exact state) and its drafter catches up. A verify step is therefore synchronous: the
scheduler does not plan a request past a verify step in flight (``Scheduler.schedule``). Chunks of the same step
without drafts are sampled with the same rows; steps without a verify chunk stay asynchronous, and the drafter only
follows them (``Speculator.follow``), unless they have decode rows and none was given drafts (the scheduler's batch
limit or cost policy): then the drafter does not run at all, and skips ahead when drafting resumes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from deepinfer.engine.interfaces import PLACEHOLDER, WorkerStepPlan
from deepinfer.engine.speculative.acceptance import kept
from deepinfer.engine.speculative.grammar import constrain


class Speculator(Protocol):
    """A model family's speculative decoding (DeepSeek-V4: ``models.deepseek_v4.speculator.MTPSpeculator``)."""

    max_drafts: int

    def propose(
        self, rids: list[str], states: list[Any], tables: list[torch.Tensor], last: list[int], counts: list[int]
    ) -> list[list[int]]:
        """At most ``counts[b]`` drafts for each sequence, whose next token (consumed by this step) is ``last[b]``."""
        ...

    def forward(
        self, batch: Any, cache: Any, verified: list[int], rids: list[str], drafts: list[int], follow: bool
    ) -> tuple[torch.Tensor, Any]:
        """The step's forward with chunks ``verified`` verifying ``drafts[k]`` drafts each: ``(hidden, pending)``;
        ``follow``: the drafter follows the step (False: its decode rows were planned without drafts)."""
        ...

    def settle(
        self, pending: Any, accepted: list[int], emitted: list[list[int]], hidden: torch.Tensor, batch: Any
    ) -> None:
        """Roll the verified sequences back to ``accepted[k]`` drafts kept (``emitted[k]``: the tokens they emit)."""
        ...

    def follow(self, batch: Any, hidden: torch.Tensor, chunks: list[int], rids: list[str]) -> None:
        """The drafter's state after a plain step of chunks ``chunks``."""
        ...

    def release(self, rids: list[str]) -> None:
        """Forget what the drafter keeps for these sequences (finished, or not followed through a step)."""
        ...


def propose(
    spec: Speculator, plan: WorkerStepPlan, chunks: list[tuple], token_ids: list[list[int]], constraints: Any = None
) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Each chunk's drafts (``[]``: none), and the verify rows' grammar masks of the constrained ones (by request:
    ``engine.speculative.grammar``); a chunk with drafts gets them appended to its tokens and its length."""
    want = [
        i for i, c in enumerate(plan.chunks)
        if c.num_drafts > 0 and c.sample and c.token_ids != [PLACEHOLDER] and len(c.token_ids) == 1
        and c.constraint is None  # (a constraint installed with this very step: no drafts yet)
    ]  # fmt: skip
    drafts: list[list[int]] = [[] for _ in plan.chunks]
    masks: dict[str, torch.Tensor] = {}
    if not want:
        return drafts, masks
    got = spec.propose(
        [plan.chunks[i].request_id for i in want], [chunks[i][0] for i in want], [chunks[i][3] for i in want],
        [token_ids[i][0] for i in want], [min(plan.chunks[i].num_drafts, spec.max_drafts) for i in want],
    )  # fmt: skip
    for i, d in zip(want, got):
        d, rid = d[: plan.chunks[i].num_drafts], plan.chunks[i].request_id
        if d and constraints is not None and rid in constraints:
            d, masks[rid] = constrain(constraints, rid, d)
            if not d:
                del masks[rid]  # a plain row: its mask comes with the step's others
        drafts[i] = d
        token_ids[i] = [token_ids[i][0], *d]
        st, start, _, table, decoder_from = chunks[i]
        chunks[i] = (st, start, 1 + len(d), table, decoder_from)
    return drafts, masks


def drafting_off(plan: WorkerStepPlan) -> bool:
    """Whether the step has decode rows and the scheduler gave none of them drafts (its batch limit or cost policy):
    the drafter then does not follow it."""
    decode = [c for c in plan.chunks if c.sample and len(c.token_ids) == 1]
    return bool(decode) and not any(c.num_drafts for c in decode)


def spec_forward(
    spec: Speculator, batch: Any, cache: Any, plan: WorkerStepPlan, drafts: list[list[int]]
) -> tuple[torch.Tensor, Any]:
    verified = [i for i, d in enumerate(drafts) if d]
    rids = [plan.chunks[i].request_id for i in verified]
    return spec.forward(batch, cache, verified, rids, [len(drafts[i]) for i in verified], not drafting_off(plan))


def settle(
    runner: Any, step: Any, plan: WorkerStepPlan, drafts: list[list[int]], pending: Any,
    hidden: torch.Tensor, batch: Any,
) -> None:  # fmt: skip
    """After a step's sampling (``runner``: the ``engine.worker.ModelRunner``, ``step``: its ``InFlight``): with
    verify chunks, collect every row now and keep each verify chunk's drafts; the speculator rolls back and follows
    (module docstring)."""
    spec = runner.spec
    verified = [i for i, d in enumerate(drafts) if d]
    plain = [i for i, d in enumerate(drafts) if not d]
    if pending is None:
        if drafting_off(plan):  # the drafter lags, skips ahead when it drafts
            spec.release([c.request_id for c in plan.chunks])
            return
        spec.follow(batch, hidden, plain, [plan.chunks[i].request_id for i in plain])
        return
    out, rows_of = step.result.results, {}
    ids, lps, top = step.host_rows()
    for j, i in enumerate(step.seqs):
        rows_of.setdefault(i, []).append(j)
    emitted: dict[int, list[int]] = {}
    judge = getattr(getattr(spec, "proposer", None), "judged", False)  # (the benchmark's judged oracle)
    for i, rows in rows_of.items():
        toks = [int(ids[j]) for j in rows]
        a = spec.proposer.keep(plan.chunks[i].request_id, drafts[i]) if judge and drafts[i] else kept(toks, drafts[i])
        rows = rows[: a + 1]
        emitted[i] = drafts[i][:a] + [toks[a]] if judge else toks[: a + 1]
        r, rid = out[i], plan.chunks[i].request_id
        r.token_id, r.logprob, r.top_logprobs = emitted[i][0], lps[rows[0]], top[rows[0]]
        r.extra_token_ids, r.num_drafts = emitted[i][1:], len(drafts[i])
        r.extra_logprobs = [lps[j] for j in rows[1:]]
        r.extra_top_logprobs = [top[j] for j in rows[1:]]
        runner.sampled[rid] = emitted[i][-1]
        if step.constrained and rid in runner.constraints:
            for t in emitted[i]:
                runner.constraints.accept(rid, t)
    step.sample = None  # collected
    spec.settle(pending, [len(emitted[i]) - 1 for i in verified], [emitted[i] for i in verified], hidden, batch)
    spec.follow(batch, hidden, plain, [plan.chunks[i].request_id for i in plain])


__all__ = ["Speculator", "drafting_off", "propose", "settle", "spec_forward"]
