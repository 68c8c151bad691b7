"""A speculative verify step of DeepSeek-V4 on the decode path: pooled state, fixed shapes, graphable.

A verify step runs, per sequence ``b`` at position ``p_b``, its last token and ``n_b`` drafts. The ragged path
(``speculative.verify``: a chunked-prefill step over per-sequence state) is exact but slow: eager attention with
per-sequence bookkeeping in every layer. This path runs the step as ``K + 1`` decode sub-steps of the same ``S`` rows
(``K = max n_b``), inside one forward: every per-row part of a layer (projections, MoE, output) runs once over all
``S·(K+1)`` rows, laid out sub-step after sub-step (row ``j·S + b`` is sequence ``b``'s token ``j``); the attention
runs ``decode_step.attend`` once per sub-step, in order, on that sub-step's rows. Sub-step ``j`` is a plain decode
step at position ``p_b + j``: it appends the row to the window ring and the compressor rings, pools the groups it
completes into the pages, and attends; a later sub-step reads what an earlier one wrote. So row ``j`` of a sequence
sees exactly the state a plain run has at ``p_b + j``, with the same kernels (``V4VerifyPlan``: one
``decode_step.V4DecodePlan`` per sub-step; a sequence with fewer drafts has dead rows in the last sub-steps, which
write only to the pool's scratch slot and the cache's scratch page).

The rollback: a rejected row at ``p_b + i`` overwrote ring row ``(p_b + i) % cap`` of every window and compressor
ring, which a later step still reads (position ``p_b + i - cap``). The step saves those rows first (``save``: ``K``
rows per sequence and ring, gathered before the first sub-step of each layer) and ``PooledVerify.rollback`` puts
the rejected ones back. Needs ``K < cap`` for every ring (ring rows of ``p_b + 1 .. p_b + K`` distinct), else the
ragged path runs. Compressed rows completed by a rejected row sit at a row no reader lists (past the sequence's
count) and are written again when the group completes with kept tokens, as on the ragged path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from deepinfer.models.deepseek_v4 import decode_step, verify_attention, verify_rings
from deepinfer.models.deepseek_v4.decode_step import V4DecodePlan, block_tables, step_widths
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import RotaryTable
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import StagedCopy, to_device

T = TypeVar("T")


@dataclass(eq=False)
class V4VerifyPlan:
    """A verify step's sub-steps (module docstring): ``subs[j]`` the plan of sub-step ``j`` (``size`` rows, sharing
    ``tables``); ``slots`` / ``base`` ``[S]`` on the device: each row's pool slot and ``p_b`` (the padding rows of a
    graphed bucket: the scratch slot). ``saved``: the ring rows ``save`` kept, by ring."""

    pool: StatePool
    subs: list[V4DecodePlan]
    slots: torch.Tensor
    base: torch.Tensor
    ids: torch.Tensor | None = None  # a graphed bucket's token ids [(K+1)·S], sub-step after sub-step
    stage: StagedCopy | None = None
    saved: dict[object, torch.Tensor] = field(default_factory=dict)
    derived: dict = field(default_factory=dict)  # what ``save`` and ``restore`` derive alike, once per step
    fused: bool = False  # the attention in one call over every sub-step's rows (``verify_attention``), else in turns

    def once(self, key: object, make: Callable[[], T]) -> T:
        """``make()`` once per step (``derived``: ``clear`` forgets it), as ``V4DecodePlan.once``."""
        got = self.derived.get(key)
        if got is None:
            got = self.derived[key] = make()
        return got

    def clear(self) -> None:
        """Forget what the sub-steps derived (a graphed bucket's step recomputes, and captures, it every run)."""
        self.derived.clear()
        for sub in self.subs:
            sub.derived.clear()

    @property
    def size(self) -> int:
        return self.subs[0].size

    @property
    def drafts(self) -> int:
        return len(self.subs) - 1

    # -- what a model's verify plan is made of (DeepSeek-V4.1's: ``deepseek_v41.verify_step``) --------------------
    META = 4  # meta rows per sub-step (``decode_step.V4DecodePlan.meta``)

    @classmethod
    def host_meta(cls, chunks: list[SeqChunk], slots: list[int], scratch: int, size: int, drafts: int
                  ) -> tuple[np.ndarray, int]:  # fmt: skip
        """The sub-steps' meta rows ``[META·(drafts+1), size]`` and the positions' end (``host_meta``)."""
        return host_meta(chunks, slots, scratch, size, drafts)

    @classmethod
    def sub_plan(cls, pool: StatePool, cache: PagedKVCache | None, window: int, meta: torch.Tensor,
                 tables: torch.Tensor | None, host: np.ndarray | None, widths: dict) -> object:  # fmt: skip
        """A sub-step's decode plan: ``meta`` its rows on the device, ``host`` the same in host memory (an eager step:
        its exact window width) or None (a graphed bucket: the whole window)."""
        return decode_step.V4DecodePlan(pool, cache, window, meta, tables, window_width(host, 2, window), widths)

    @staticmethod
    def attend_sub(attn: object, t: dict[str, torch.Tensor], sub: object, rope: RotaryTable, ops: Ops) -> torch.Tensor:
        """A sub-step's attention (``decode_step.attend``)."""
        return decode_step.attend(attn, t, sub, rope, ops)

    @staticmethod
    def attend_all(attn: object, t: dict[str, torch.Tensor], plan: V4VerifyPlan, rope: RotaryTable, ops: Ops
                   ) -> torch.Tensor:  # fmt: skip
        """Every sub-step's attention in one call (``verify_attention.attend``)."""
        return verify_attention.attend(attn, t, plan, rope, ops)

    # -- building ------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, pool: StatePool, cache: PagedKVCache | None, window: int, size: int, drafts: int, span: int
              ) -> V4VerifyPlan:  # fmt: skip
        """A graphed bucket's plan: ``size`` rows, ``drafts + 1`` sub-steps, lists wide enough for positions below
        ``span``."""
        widths, tables = decode_step.bucket_widths(cache, size, span, pool.device)
        k1, r = drafts + 1, cls.META
        buf = torch.zeros((r + 1) * k1 + 1, size, dtype=torch.long, device=pool.device)  # meta rows, base, the ids
        subs = [cls.sub_plan(pool, cache, window, buf[r * j : r * j + r], tables, None, widths) for j in range(k1)]
        return cls(pool, subs, buf[0], buf[r * k1], ids=buf[r * k1 + 1 :].view(-1), stage=StagedCopy(buf))

    @classmethod
    def of(cls, pool: StatePool, cache: PagedKVCache | None, window: int, chunks: list[SeqChunk],
           drafts: int | None = None) -> V4VerifyPlan:  # fmt: skip
        """An eager step's plan of ``chunks`` (each its token and drafts), exact widths; ``drafts``: sub-steps less
        one (default: the most drafts of a chunk)."""
        slots = pool.adopt([c.state for c in chunks])
        k = max(c.length for c in chunks) - 1 if drafts is None else drafts
        host, top = cls.host_meta(chunks, slots, pool.scratch, len(chunks), k)
        meta = to_device(torch.from_numpy(host), pool.device)
        widths, pages = step_widths(cache, top)
        tables = None if cache is None else block_tables(_last_rows(chunks), pages, cache)
        r = cls.META
        subs = [
            cls.sub_plan(pool, cache, window, meta[r * j : r * j + r], tables, host[r * j : r * j + r], widths)
            for j in range(k + 1)
        ]
        return cls(pool, subs, meta[0], to_device(torch.tensor([c.start for c in chunks]), pool.device))

    def fill(self, chunks: list[SeqChunk], slots: list[int], batch: ForwardBatch) -> None:
        """Load a graphed bucket's plan and token ids with ``chunks`` (at most ``size``, at most ``drafts`` drafts
        each; ``batch``: their rows, sequence after sequence): one host copy; the rows past them are padding."""
        n, k1, size, r = len(chunks), len(self.subs), self.size, self.META
        host, top = self.host_meta(chunks, slots, self.pool.scratch, size, k1 - 1)
        full = np.zeros((self.stage.dst.shape[0], size), dtype=np.int64)
        full[: r * k1] = host
        full[r * k1, :n] = [c.start for c in chunks]
        rows = verify_rows(chunks, size)
        if batch.host_token_ids is not None:
            full[r * k1 + 1 :].reshape(-1)[rows] = batch.host_token_ids.numpy()
        self.stage.copy(torch.from_numpy(full))
        if batch.host_token_ids is None:  # ids on the device only (an earlier step's samples): copied there
            self.ids.index_copy_(0, to_device(torch.from_numpy(rows), self.ids.device), batch.token_ids)
        cache = self.subs[0].cache
        if cache is not None:
            tables = self.subs[0].tables
            pages, held = step_widths(cache, top)[1], tables.shape[1]
            if pages > held:
                raise ValueError(f"verify step: {pages} pages a sequence needed, the bucket holds {held}")
            tables[:n, :pages].copy_(block_tables(_last_rows(chunks), pages, cache))


def window_width(host: np.ndarray | None, floor: int, window: int) -> int:
    """A sub-step's window width: its live rows' longest window (``host``: its meta rows; ``floor``: the row of the
    lowest window position), or the whole window (None)."""
    if host is None:
        return window
    live = host[3] == 1
    pos, low = host[1][live], host[floor][live]
    return int((pos - np.maximum(np.maximum(low, pos - window + 1), 0)).max(initial=0)) + 1


def _last_rows(chunks: list[SeqChunk]) -> list[SeqChunk]:
    """One row per chunk at its last position (what its block table must cover)."""
    return [SeqChunk(c.state, c.end - 1, 1, c.block_table) for c in chunks]


def host_meta(chunks: list[SeqChunk], slots: list[int], scratch: int, size: int, drafts: int) -> tuple[np.ndarray, int]:
    """The sub-steps' meta rows ``[4·(drafts+1), size]`` (slot, position, window start, liveness per sub-step; a
    row past its chunk's drafts, or past the chunks, is dead: the scratch slot, its chunk's last position) and the
    positions' end."""
    n, k1 = len(chunks), drafts + 1
    start = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    length = np.fromiter((c.length for c in chunks), dtype=np.int64, count=n)
    floor = np.fromiter((c.state.window_start for c in chunks), dtype=np.int64, count=n)
    host = np.zeros((k1, 4, size), dtype=np.int64)
    j = np.arange(k1).reshape(-1, 1)
    live = j < length
    host[:, 0] = scratch
    host[:, 0, :n] = np.where(live, np.asarray(slots, dtype=np.int64), scratch)
    host[:, 1, :n] = np.minimum(start + j, start + length - 1)  # a dead row: its chunk's last position
    host[:, 2, :n] = floor
    host[:, 3, :n] = live
    return host.reshape(4 * k1, size), int((start + length).max())


def verify_rows(chunks: list[SeqChunk], size: int) -> np.ndarray:
    """Where each row of ``chunks`` (sequence after sequence) sits in the sub-step layout (``j·size + b``)."""
    length = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
    b = np.repeat(np.arange(len(chunks)), length)
    j = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    return j * size + b


def eligible(model: torch.nn.Module, chunks: list[SeqChunk]) -> bool:
    """Whether a step of ``chunks`` (each its token and its drafts, maybe none) runs on this path: the model decodes
    on pooled state, every chunk starts where its sequence stands with no bounded replay, and every ring holds its
    drafts' rows apart (module docstring)."""
    if not getattr(model, "verify_on_decode_path", False) or not chunks:
        return False
    if model.ops.batch_invariant or not model.pooled_decode:
        return False
    k = max(c.length for c in chunks) - 1
    return k < verify_rings.ring_rows(model) and all(
        c.state.replay_until <= c.start == c.state.num_tokens for c in chunks
    )


# -- inside the forward: each layer's attention ---------------------------------------------------------------------
def attend(attn: object, t: dict[str, torch.Tensor], plan: V4VerifyPlan, rope: RotaryTable, ops: Ops,
           keep: bool = True) -> torch.Tensor:  # fmt: skip
    """The attention output ``[(K+1)·S, H, d]`` of a layer for the verify step ``plan``: what the drafts will
    overwrite saved (``keep``; not for rows that all stay, as the MTP block's observed ones: ``verify_rings``), then
    every sub-step's rows in one call (``plan.fused``: ``verify_attention``), else the sub-steps in order (module
    docstring), each on its rows of every per-row tensor of ``t``."""
    if keep:
        verify_rings.save(attn, plan, t)
    if plan.fused:
        return plan.attend_all(attn, t, plan, rope, ops)
    s, n, outs = plan.size, plan.size * len(plan.subs), []
    for j, sub in enumerate(plan.subs):
        rows = {k: v[j * s : (j + 1) * s] for k, v in t.items() if v.ndim and v.shape[0] == n}
        outs.append(plan.attend_sub(attn, rows, sub, rope, ops))
    return torch.cat(outs)


@dataclass
class VerifiedSeq:
    """A verified sequence: its state, ``p_b`` (tokens consumed before the step) and ``n_b`` (its drafts)."""

    state: SequenceState
    start: int
    drafts: int


def check_rollback(done: bool, saves: list, accepted: list[int]) -> None:
    """Refuse a rollback that cannot be right: a second one, counts for other sequences, more drafts kept than were
    verified, or a state that moved since its verify step (``saves``: ``VerifiedSeq`` or ``speculative.SeqSave``)."""
    if done:
        raise RuntimeError("a verify step is rolled back once")
    if len(accepted) != len(saves):
        raise ValueError(f"{len(accepted)} counts for {len(saves)} sequences")
    for save, a in zip(saves, accepted):
        if not 0 <= a <= save.drafts:
            raise ValueError(f"{a} drafts kept out of {save.drafts}")
        want = save.start + save.drafts + 1
        if save.state.num_tokens != want:
            raise RuntimeError(f"the state moved since its verify step: {save.state.num_tokens} != {want}")


@dataclass
class PooledVerify:
    """A verify forward on this path: what ``speculative.VerifyStep`` offers the speculators (``offsets``: each
    verified sequence's rows in the step's hidden rows, ``saves``: its state, ``p_b`` and ``n_b``)."""

    model: torch.nn.Module
    plan: V4VerifyPlan
    offsets: list[tuple[int, int]]
    saves: list[VerifiedSeq]
    rows: list[int]  # each verified sequence's row in the plan
    restore: Callable[[torch.Tensor], None] | None = None  # puts back the rejected rows (``verify_rings.restore``'s)
    steps: list[int] = field(default_factory=list)  # each chunk's tokens less one (a chunk not verified keeps all)
    histories: list[tuple[int, ...]] | None = None  # V4.1's Engram histories before the step, of the verified
    ids: list[int] | None = None  # the step's token ids on the host (``batch``'s rows), where ``histories``
    hidden: torch.Tensor | None = None  # (speculative.verify: the step's hidden streams and logits)
    logits: torch.Tensor | None = None
    done: bool = False

    def rollback(self, accepted: list[int]) -> None:
        """Bring every verified sequence to ``p_b + accepted[b] + 1`` consumed tokens."""
        check_rollback(self.done, self.saves, accepted)
        full = list(self.steps) + [0] * (self.plan.size - len(self.steps))  # rows not verified: every token kept
        for a, r in zip(accepted, self.rows):
            full[r] = a
        self.restore(to_device(torch.tensor(full), self.plan.base.device))
        for k, (save, a) in enumerate(zip(self.saves, accepted)):
            save.state.num_tokens = save.start + a + 1
            if self.histories is not None and save.state.history:
                lo = self.offsets[k][0]
                save.state.history = kept_history(self.histories[k], self.ids[lo : lo + a + 1], len(save.state.history))
        self.done = True


def kept_history(before: tuple[int, ...], kept: list[int], n: int) -> tuple[int, ...]:
    """DeepSeek-V4.1's Engram history (the last ``n`` tokens consumed, -1 before the first) after a verify step:
    the history before it, then the kept tokens."""
    return tuple(([-1] * n + list(before) + list(kept))[-n:])


@torch.no_grad()
def pooled_forward(model: torch.nn.Module, batch: ForwardBatch, cache: PagedKVCache | None, verified: list[int],
                   pad: int = 0) -> tuple[torch.Tensor, PooledVerify]:  # fmt: skip
    """The model's forward on ``batch`` (chunks sequence after sequence; chunks ``verified`` carry drafts, the
    others one token; ``eligible``) on this path: the hidden streams in ``batch``'s row order, and the rollback.
    ``pad``: a graphed step runs at least that many sub-steps less one (the drafter's most drafts: a step whose
    drafts were cut, near a request's ``max_tokens``, replays the graphs of full ones instead of capturing its own)."""
    chunks, offsets = batch.chunks, batch.offsets()
    model._use_pool(True)
    pool = model.state_pool
    saves = [VerifiedSeq(chunks[i].state, chunks[i].start, chunks[i].length - 1) for i in verified]
    graphs = model.step_graphs.of(model, "verify") if model.step_graphs is not None else None
    got = None if graphs is None else graphs.run(batch, cache, pad if pad < verify_rings.ring_rows(model) else 0)
    if got is not None:  # replayed: the bucket's rows, its restore
        hs, bk = got
        at = to_device(torch.from_numpy(verify_rows(chunks, bk.size)), batch.device)
        for c in chunks:
            c.state.num_tokens = c.end
        return hs.index_select(0, at), PooledVerify(model, bk.plan, [offsets[i] for i in verified], saves, verified,
                                                    steps=[c.length - 1 for c in chunks],
                                                    restore=lambda acc: graphs.restore(bk, acc))  # fmt: skip
    plan = V4VerifyPlan.of(pool, cache, model.config.sliding_window, chunks)
    plan.fused = model.verify_fused
    size, k1 = len(chunks), plan.drafts + 1
    at = to_device(torch.from_numpy(verify_rows(chunks, size)), batch.device)
    ids = batch.token_ids.new_zeros(k1 * size).index_copy_(0, at, batch.token_ids)
    pos = torch.cat([sub.meta[1] for sub in plan.subs])
    pool.verify = plan
    try:
        h = model(ForwardBatch(ids, pos, chunks), cache).index_select(0, at)
    finally:
        pool.verify = None
    return h, PooledVerify(model, plan, [offsets[i] for i in verified], saves, verified,
                           steps=[c.length - 1 for c in chunks],
                           restore=lambda acc: verify_rings.restore(model, plan, acc))  # fmt: skip


__all__ = [
    "PooledVerify", "V4VerifyPlan", "VerifiedSeq", "attend", "check_rollback", "eligible", "host_meta", "kept_history",
    "pooled_forward", "verify_rows", "window_width",
]  # fmt: skip
