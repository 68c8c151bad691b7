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

import numpy as np
import torch

from deepinfer.models.deepseek_v4 import decode_step
from deepinfer.models.deepseek_v4.decode_step import V4DecodePlan, block_tables, step_widths
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import RotaryTable
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import StagedCopy, to_device

ROW_KEYS = ("q", "kv", "main_kv", "main_score", "index_kv", "index_score", "iq", "iw")  # what ``attend`` reads


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

    @classmethod
    def empty(cls, pool: StatePool, cache: PagedKVCache | None, window: int, size: int, drafts: int, span: int
              ) -> V4VerifyPlan:  # fmt: skip
        """A graphed bucket's plan: ``size`` rows, ``drafts + 1`` sub-steps, lists wide enough for positions below
        ``span``."""
        widths, tables = decode_step.bucket_widths(cache, size, span, pool.device)
        k1 = drafts + 1
        buf = torch.zeros(5 * k1 + 1, size, dtype=torch.long, device=pool.device)  # meta rows, base, then the ids
        subs = [V4DecodePlan(pool, cache, window, buf[4 * j : 4 * j + 4], tables, window, widths) for j in range(k1)]
        return cls(pool, subs, buf[0], buf[4 * k1], ids=buf[4 * k1 + 1 :].view(-1), stage=StagedCopy(buf))

    @classmethod
    def of(cls, pool: StatePool, cache: PagedKVCache | None, window: int, chunks: list[SeqChunk],
           drafts: int | None = None) -> V4VerifyPlan:  # fmt: skip
        """An eager step's plan of ``chunks`` (each its token and drafts), exact widths; ``drafts``: sub-steps less
        one (default: the most drafts of a chunk)."""
        slots = pool.adopt([c.state for c in chunks])
        k = max(c.length for c in chunks) - 1 if drafts is None else drafts
        host, top = host_meta(chunks, slots, pool.scratch, len(chunks), k)
        meta = to_device(torch.from_numpy(host), pool.device)
        widths, pages = step_widths(cache, top)
        tables = None if cache is None else block_tables(_last_rows(chunks), pages, cache)
        subs = []
        for j in range(host.shape[0] // 4):
            rows = host[4 * j : 4 * j + 4]
            live = rows[3] == 1
            pos, floor = rows[1][live], rows[2][live]
            win = int((pos - np.maximum(np.maximum(floor, pos - window + 1), 0)).max(initial=0)) + 1
            subs.append(V4DecodePlan(pool, cache, window, meta[4 * j : 4 * j + 4], tables, win, widths))
        return cls(pool, subs, meta[0], to_device(torch.tensor([c.start for c in chunks]), pool.device))

    def fill(self, chunks: list[SeqChunk], slots: list[int], batch: ForwardBatch) -> None:
        """Load a graphed bucket's plan and token ids with ``chunks`` (at most ``size``, at most ``drafts`` drafts
        each; ``batch``: their rows, sequence after sequence): one host copy; the rows past them are padding."""
        n, k1, size = len(chunks), len(self.subs), self.size
        host, top = host_meta(chunks, slots, self.pool.scratch, size, k1 - 1)
        full = np.zeros((self.stage.dst.shape[0], size), dtype=np.int64)
        full[: 4 * k1] = host
        full[4 * k1, :n] = [c.start for c in chunks]
        rows = verify_rows(chunks, size)
        if batch.host_token_ids is not None:
            full[4 * k1 + 1 :].reshape(-1)[rows] = batch.host_token_ids.numpy()
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
    return k < ring_rows(model) and all(c.state.replay_until <= c.start == c.state.num_tokens for c in chunks)


def ring_rows(model: torch.nn.Module) -> int:
    """The fewest rows of any of the model's rings (its window, its compressors' ``m`` or ``2m``): walked once per
    model (every verify step asks)."""
    got = model.__dict__.get("_ring_rows")
    if got is None:
        caps = [model.config.sliding_window]
        for layer in model.layers:
            caps += [2 * c.ratio if c.overlap else c.ratio for _, c in layer.attn.pending()]
        got = model.__dict__["_ring_rows"] = min(caps)
    return got


# -- inside the forward: each layer's attention ---------------------------------------------------------------------
def attend(attn: decode_step.AttentionLayer, t: dict[str, torch.Tensor], plan: V4VerifyPlan, rope: RotaryTable,
           ops: Ops, keep: bool = True) -> torch.Tensor:  # fmt: skip
    """The attention output ``[(K+1)·S, H, d]`` of a layer for the verify step ``plan``: the rows the drafts will
    overwrite saved (``keep``; not for rows that all stay, as the MTP block's observed ones), then the sub-steps in
    order (module docstring)."""
    if keep:
        save(attn, plan)
    s, outs = plan.size, []
    for j, sub in enumerate(plan.subs):
        rows = {k: t[k][j * s : (j + 1) * s] for k in ROW_KEYS if k in t}
        outs.append(decode_step.attend(attn, rows, sub, rope, ops))
    return torch.cat(outs)


def _rings(attn: decode_step.AttentionLayer, pool: StatePool) -> list[tuple[object, list[torch.Tensor]]]:
    """A layer's rings that a verify step writes: its window ring and its compressors' (kv, score) rings."""
    out = [(attn.layer_id, [pool.rings[attn.layer_id]])]
    for name, comp in (("main", attn.compressor), ("index", attn.indexer and attn.indexer.compressor)):
        if comp is not None:
            out.append(((attn.layer_id, name), list(pool.rbufs[(attn.layer_id, name)])))
    return out


def _ring_rows(plan: V4VerifyPlan, cap: int) -> torch.Tensor:
    """Each row's ring rows of positions ``p_b + 1 .. p_b + K`` in a ring of ``cap`` rows viewed ``[slots·cap,
    d]`` (``[S·K]``), once per step and ring size."""

    def make() -> torch.Tensor:
        k = torch.arange(1, plan.drafts + 1, device=plan.base.device)
        return (plan.slots.unsqueeze(1) * cap + (plan.base.unsqueeze(1) + k) % cap).reshape(-1)

    got = plan.derived.get(("rows", cap))
    if got is None:
        got = plan.derived[("rows", cap)] = make()
    return got


def save(attn: decode_step.AttentionLayer, plan: V4VerifyPlan) -> None:
    """Keep the rows of positions ``p_b + 1 .. p_b + K`` of the layer's rings (``plan.saved[key]`` ``[n, S·K, d]``:
    written into the buffers there, if any: a graphed bucket's)."""
    if plan.drafts == 0:
        return
    for key, tensors in _rings(attn, plan.pool):
        rows = _ring_rows(plan, tensors[0].shape[1])
        got = torch.stack([x.view(-1, x.shape[-1]).index_select(0, rows) for x in tensors])
        if key in plan.saved:
            plan.saved[key].copy_(got)
        else:
            plan.saved[key] = got


def allocate_saves(model: torch.nn.Module, plan: V4VerifyPlan) -> None:
    """The buffers ``save`` writes into (a graphed bucket's, made before its capture)."""
    n = plan.size * plan.drafts
    for layer in model.layers:
        for key, tensors in _rings(layer.attn, plan.pool):
            x = tensors[0]
            plan.saved[key] = torch.zeros(len(tensors), n, x.shape[-1], dtype=x.dtype, device=x.device)


def restore(model: torch.nn.Module, plan: V4VerifyPlan, accepted: torch.Tensor) -> None:
    """Put back the saved rows of the rejected positions ``p_b + a_b + 1 .. p_b + K`` (``accepted [S]`` on the
    device: ``a_b``) in every layer's rings."""
    if plan.drafts == 0:
        return
    k = torch.arange(1, plan.drafts + 1, device=accepted.device)
    reject = (k.unsqueeze(0) > accepted.unsqueeze(1)).reshape(-1, 1)
    for layer in model.layers:
        for key, tensors in _rings(layer.attn, plan.pool):
            rows = _ring_rows(plan, tensors[0].shape[1])
            for x, old in zip(tensors, plan.saved[key]):
                flat = x.view(-1, x.shape[-1])
                flat.index_copy_(0, rows, torch.where(reject, old, flat.index_select(0, rows)))


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
    restore: Callable[[torch.Tensor], None] | None = None  # puts back the rejected rows (``restore``'s)
    hidden: torch.Tensor | None = None  # (speculative.verify: the step's hidden streams and logits)
    logits: torch.Tensor | None = None
    done: bool = False

    def rollback(self, accepted: list[int]) -> None:
        """Bring every verified sequence to ``p_b + accepted[b] + 1`` consumed tokens."""
        check_rollback(self.done, self.saves, accepted)
        full = [self.plan.drafts] * self.plan.size  # rows not verified: nothing drafted, nothing to put back
        for a, r in zip(accepted, self.rows):
            full[r] = a
        self.restore(to_device(torch.tensor(full), self.plan.base.device))
        for save, a in zip(self.saves, accepted):
            save.state.num_tokens = save.start + a + 1
        self.done = True


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
    got = None if graphs is None else graphs.run(batch, cache, pad if pad < ring_rows(model) else 0)
    if got is not None:  # replayed: the bucket's rows, its restore
        hs, bk = got
        at = to_device(torch.from_numpy(verify_rows(chunks, bk.size)), batch.device)
        for c in chunks:
            c.state.num_tokens = c.end
        return hs.index_select(0, at), PooledVerify(model, bk.plan, [offsets[i] for i in verified], saves, verified,
                                                    restore=lambda acc: graphs.restore(bk, acc))  # fmt: skip
    plan = V4VerifyPlan.of(pool, cache, model.config.sliding_window, chunks)
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
                           restore=lambda acc: restore(model, plan, acc))  # fmt: skip


__all__ = [
    "PooledVerify", "V4VerifyPlan", "VerifiedSeq", "allocate_saves", "attend", "check_rollback", "eligible",
    "pooled_forward", "restore", "ring_rows", "save", "verify_rows",
]  # fmt: skip
