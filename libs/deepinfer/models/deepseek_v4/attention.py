"""Shared-KV MQA with sink, and its compressed branches (docs/deepseek_v4.md: "Attention: shared-KV MQA",
"Sliding-window attention (SWA)", "Heavily compressed attention (HCA)", "Compressed sparse attention (CSA)").

Every layer attends to the window rows (the last ``W`` raw KV rows, the current token included);
HCA layers add every complete compressed row, CSA layers add the indexer's top-k compressed rows.
The long-term rows go to the paged cache, the window and the compressor buffers to the sequence.

Two paths compute the same attention. With batch-invariant ops each sequence attends alone (``_attend_one``: its
keys and mask, one ``ops.sparse_attention`` call per sequence), which keeps that mode's results what they were. Every
other op set takes the batched path (``_attend_batched``): the state bookkeeping stays per sequence (window ring,
compressor buffers, page writes: cheap views and copies), while the work runs once for the whole batch: one pool of
window rows, one gather of every sequence's compressed rows (``PagedKVCache.read_many``), one indexer scoring and
top-k over per-query row ranges, and one ``ops.sparse_attention_lists`` over per-query key lists (window rows by
position, then compressed rows by index). A decode step (one token per sequence) keeps the bookkeeping off the
per-sequence loop too: the windows and compressor buffers live in the model's ``StatePool`` (a slot per sequence),
and ``decode_step.attend`` runs the step in fixed shapes from a ``V4DecodePlan`` (what the decode CUDA graph captures).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4 import decode_step, verify_step
from deepinfer.models.deepseek_v4.compressor import Compressor, Indexer, quant_block
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.decode_step import V4DecodePlan
from deepinfer.models.deepseek_v4.forward_batch import SeqChunk
from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable, join_rows, rows_forward, rows_fp32
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState
from deepinfer.models.deepseek_v4.state import ring_span as _ring_span
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.models.deepseek_v4.window_lists import WindowLists, step_window_lists
from deepinfer.ops import Ops
from deepinfer.parallel.tensor_parallel import reduce_output
from deepinfer.runtime.host_copy import to_device


class Attention(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        c = config
        self.layer_id, self.ratio = layer_id, c.ratio(layer_id)
        self.kind = c.layer_kind(layer_id)
        self.n_heads, self.head_dim, self.rd = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim
        self.window, self.eps = c.sliding_window, c.rms_norm_eps
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, fp8=True)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, fp8=True)
        self.wkv = Linear(c.hidden_size, self.head_dim, fp8=True)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank, fp8=True)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, c.hidden_size, fp8=True)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.compressor = None
        self.indexer = None
        if self.ratio:
            self.compressor = Compressor(c, self.ratio, self.head_dim, overlap=self.kind == "csa", rotate=False)
            if self.kind == "csa":
                self.indexer = Indexer(c, self.ratio)
        self.quant_sim = False
        self.state_pool: StatePool | None = None  # set by the model (decode steps on pooled state)
        # a dict while a speculative verify step runs (speculative.py): ``attend`` leaves the compressors' projections
        # of the step there (``{name: (kv, score)}``), which the rollback rebuilds the kept buffers from
        self.capture: dict | None = None
        self.tp = None  # this layer's tensor-parallel group: its heads only (``parallel.tensor_parallel``)

    def _compressors(self) -> list[tuple[str, Compressor]]:
        """The layer's compressors by the name of their projections in ``project``'s tensors."""
        index = self.indexer.compressor if self.indexer is not None else None
        return [(name, c) for name, c in (("main", self.compressor), ("index", index)) if c is not None]

    def pending(self) -> list[tuple[str, Compressor]]:
        """The compressors that keep pending rows between steps (every one here), by name (speculative rollback)."""
        return self._compressors()

    def keep_pending(self, state: SequenceState, key: tuple[int, str], buf: CompressorBuffer) -> None:
        """Store a compressor's pending rows (a speculative rollback's)."""
        state.set_buffer(key, buf)

    def join_projections(self) -> None:
        """Make the projections of the layer's input one GEMM each (``layers.join_rows``; a backend's
        ``prepare_weights``): ``wq_a`` with ``wkv``, and the compressors' ``wkv`` / ``wgate``."""
        join_rows([self.wq_a, self.wkv])
        join_rows([lin for _, c in self._compressors() for lin in (c.wkv, c.wgate)])

    def forward(
        self,
        x: torch.Tensor,
        chunks: list[SeqChunk],
        offsets: list[tuple[int, int]],
        positions: torch.Tensor,
        cache: PagedKVCache | None,
        rope: RotaryTable,
        ops: Ops,
    ) -> torch.Tensor:
        t = self.project(x, positions, rope, ops)
        return self.output(self.attend(t, chunks, offsets, positions, cache, rope, ops), t, ops)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, ops: Ops) -> dict[str, torch.Tensor]:
        """Everything before the state is touched, one row per token (``x`` the normalised input): ``x``, ``qr``,
        ``q``, ``kv``, ``cos``, ``sin``, the compressors' projections (``main_kv`` / ``main_score``, ``index_kv`` /
        ``index_score``) and, off the batch-invariant path, the indexer's queries (``iq``, ``iw``). A pure function of
        its inputs (the decode CUDA graphs capture it)."""
        n_tok, h, d, rd = x.shape[0], self.n_heads, self.head_dim, self.rd
        qa, kva = rows_forward(x, [self.wq_a, self.wkv], ops)
        qr = self.q_norm(qa, ops)
        q = self.wq_b(qr, ops).view(n_tok, h, d)
        q = ops.rms_norm(q, None, self.eps)
        cos, sin = rope(positions, ops)
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1), inplace=True)
        kv = ops.rope(self.kv_norm(kva, ops), cos, sin, inplace=True)
        if self.quant_sim:
            kv = torch.cat([ops.act_quant_sim(kv[:, :-rd], quant_block(d - rd)), kv[:, -rd:]], dim=-1)
        t = {"x": x, "qr": qr, "q": q, "kv": kv, "cos": cos, "sin": sin}
        comps = self._compressors()
        outs = rows_fp32(x, [lin for _, c in comps for lin in (c.wkv, c.wgate)], ops) if comps else []
        for i, (name, c) in enumerate(comps):
            t[f"{name}_kv"], t[f"{name}_score"] = outs[2 * i], c.score(outs[2 * i + 1], positions, ops)
        if self.indexer is not None and not ops.invariant_by_sequence:
            t["iq"], t["iw"] = self.indexer.queries(x, qr, positions, rope, ops)
        return t

    def attend(
        self,
        t: dict[str, torch.Tensor],
        chunks: list[SeqChunk],
        offsets: list[tuple[int, int]],
        positions: torch.Tensor,
        cache: PagedKVCache | None,
        rope: RotaryTable,
        ops: Ops,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output ``[T, H, d]`` of ``project``'s tensors; reads and advances each sequence's state.
        ``out``: written there and returned (a piecewise CUDA graph reads it from a fixed address)."""
        x, qr, q, kv = t["x"], t["qr"], t["q"], t["kv"]
        proj = {k: (t[f"{k}_kv"], t[f"{k}_score"]) for k in ("main", "index") if f"{k}_kv" in t}
        if self.capture is not None:  # copies: a piecewise graph's buffers are reused by its later pieces
            self.capture.update({k: (kv_.clone(), score.clone()) for k, (kv_, score) in proj.items()})
        if ops.invariant_by_sequence:
            out = torch.empty_like(q) if out is None else out
            for chunk, (a, b) in zip(chunks, offsets):
                part = {k: (v[0][a:b], v[1][a:b]) for k, v in proj.items()}
                out[a:b] = self._attend_one(
                    x[a:b], qr[a:b], q[a:b], kv[a:b], positions[a:b], part, chunk, cache, rope, ops
                )
            return out
        pool = self.state_pool
        if pool is not None and pool.verify is not None:  # a verify step on the decode path
            res = verify_step.attend(self, t, pool.verify, rope, ops)
            if out is None:
                return res
            out[: res.shape[0]].copy_(res)  # (a piecewise graph's buffer: a bucket's rows)
            return out
        if pool is not None and pool.memo(chunks, "decode", lambda: _pooled_decode(chunks)):
            if self.compressor is not None and cache is None:
                raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
            plan = pool.memo(chunks, "plan", lambda: V4DecodePlan.of(pool, cache, self.window, chunks))
            res = decode_step.attend(self, t, plan, rope, ops)
            return res if out is None else out.copy_(res)
        iq = (t["iq"], t["iw"]) if "iq" in t else None
        return self._attend_batched(x, q, kv, iq, proj, chunks, offsets, cache, rope, ops, out)

    def pool_specs(self) -> tuple[dict, dict]:
        """This layer's window ring ``{layer: (rows, dim)}`` and compressor rings ``{(layer, name): (cap, dim, ratio,
        overlap)}`` (``StatePool.register``)."""
        bufs = {}
        for name, comp in (("main", self.compressor), ("index", self.indexer and self.indexer.compressor)):
            if comp is not None:
                m = comp.ratio
                bufs[(self.layer_id, name)] = (2 * m if comp.overlap else m, comp.wkv.weight.shape[0], m, comp.overlap)
        return {self.layer_id: (self.window, self.head_dim)}, bufs

    def output(self, out: torch.Tensor, t: dict[str, torch.Tensor], ops: Ops) -> torch.Tensor:
        """Inverse RoPE, then the grouped ``wo_a`` and ``wo_b``: ``[T, hidden]``."""
        n_tok, cos, sin = out.shape[0], t["cos"], t["sin"]
        out = ops.rope(out, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True, inplace=True)
        z = self.wo_a.grouped(out.view(n_tok, self.o_groups, -1), ops)
        return reduce_output(self, self.wo_b(z.flatten(1), ops))

    def _attend_one(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        proj: dict[str, tuple[torch.Tensor, torch.Tensor]],
        chunk: SeqChunk,
        cache: PagedKVCache | None,
        rope: RotaryTable,
        ops: Ops,
    ) -> torch.Tensor:
        st, s, e, win = chunk.state, chunk.start, chunk.end, self.window
        ring = st.window(self.layer_id, win, self.head_dim, kv.dtype, kv.device)
        old = torch.arange(max(st.window_start, s - win + 1), s, device=x.device)  # a replay sees no older rows
        keys = torch.cat([ring[old % win], kv])
        kpos = torch.cat([old, torch.arange(s, e, device=x.device)])  # (``positions``: the queries', maybe fewer)
        t = positions.unsqueeze(1)
        mask = (kpos.unsqueeze(0) <= t) & (kpos.unsqueeze(0) > t - win)
        if self.compressor is not None:
            if cache is None:
                raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
            count = e // self.ratio
            rows = self._compress(self.compressor, proj["main"], chunk, "main", cache, rope, ops, kv.dtype)
            visible = torch.arange(count, device=x.device).unsqueeze(0) < ((positions + 1) // self.ratio).unsqueeze(1)
            if self.indexer is not None:
                ikeys = self._compress(
                    self.indexer.compressor, proj["index"], chunk, "index", cache, rope, ops, kv.dtype
                )
                visible = self.indexer.select(x, qr, positions, ikeys, rope, ops)
            keys = torch.cat([keys, rows])
            mask = torch.cat([mask, visible], dim=1)
        # the ring keeps the last `win` rows
        keep = torch.arange(max(s, e - win), e, device=x.device)
        ring[keep % win] = kv[keep - s]
        return ops.sparse_attention(q, keys, mask, self.attn_sink, self.head_dim**-0.5)

    def _attend_batched(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        iq: tuple[torch.Tensor, torch.Tensor] | None,
        proj: dict[str, tuple[torch.Tensor, torch.Tensor]],
        chunks: list[SeqChunk],
        offsets: list[tuple[int, int]],
        cache: PagedKVCache | None,
        rope: RotaryTable,
        ops: Ops,
        out: torch.Tensor | None = None,
        sel: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of every chunk at once (module docstring); the same keys and masks as ``_attend_one``. ``iq``: the
        indexer's queries and head weights (CSA layers); ``out``: ``attend``'s. ``sel``: the step's rows whose
        queries ``q`` and ``iq`` hold (context parallelism: this rank's; the state takes every row's ``kv``)."""
        if self.compressor is not None and cache is None:
            raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
        win = self.window
        wl = step_window_lists(self.state_pool, chunks, offsets, win)
        # -- the window: each chunk's old rows (ring slots, in position order) then its new rows, in one pool
        pieces = []
        for chunk, (a, b), first in zip(chunks, offsets, wl.lo):
            ring = chunk.state.window(self.layer_id, win, self.head_dim, kv.dtype, kv.device)
            pieces += _ring_span(ring, first, chunk.start - first) + [kv[a:b]]
        window_pool = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        # the ring keeps the last `win` rows (after the pool has read the old ones)
        dst, src = [], []
        for chunk, (a, b) in zip(chunks, offsets):
            s, e = chunk.start, chunk.end
            keep = max(s, e - win)
            dst += _ring_span(chunk.state.windows[self.layer_id], keep, e - keep)
            src += _split_like(kv[a + keep - s : b], dst[len(src) :])
        if dst:
            torch._foreach_copy_(dst, src)
        rows = index = None
        if self.compressor is not None:
            rows = self._compress_batched(self.compressor, proj["main"], chunks, offsets, "main", cache, rope, ops,
                                          kv.dtype)  # fmt: skip
        if self.indexer is not None:
            index = self._compress_batched(self.indexer.compressor, proj["index"], chunks, offsets, "index", cache,
                                           rope, ops, kv.dtype)  # fmt: skip
        if sel is not None:
            wl = wl.select(sel)
        return self._attend_pools(q, iq, window_pool, wl, chunks, rows, index, ops, out)

    def _attend_pools(
        self,
        q: torch.Tensor,
        iq: tuple[torch.Tensor, torch.Tensor] | None,
        window_pool: torch.Tensor,
        wl: WindowLists,
        chunks: list[SeqChunk],
        rows: tuple[torch.Tensor, list[int]] | None,
        index: tuple[torch.Tensor, list[int]] | None,
        ops: Ops,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sparse attention of every token over its window rows (``window_pool[w_start .. + w_cnt]`` of ``wl``) and,
        in compressed layers, its compressed rows (``rows``: pool + each chunk's row-0 offset; CSA: the indexer's
        choice among them, scored on ``index``)."""
        dev, width = q.device, wl.width
        if rows is None:
            idx, cnt = wl.device(dev)
            return ops.sparse_attention_lists(q, window_pool, idx, cnt, self.attn_sink, self.head_dim**-0.5, out=out)
        w_start, w_cnt, pos, cid = wl.w_start, wl.w_cnt, wl.pos, wl.cid
        m = self.ratio
        rows_pool, roff = rows
        r_width = max((c.end // m for c in chunks), default=0)
        meta = [w_start, w_cnt, torch.tensor(roff, dtype=torch.long)[cid] + window_pool.shape[0], (pos + 1) // m]
        if index is not None:
            meta.append(torch.tensor(index[1], dtype=torch.long)[cid])
        meta_d = to_device(torch.stack(meta), dev)
        w_start, w_cnt, r_start, r_vis = meta_d[0], meta_d[1], meta_d[2], meta_d[3]

        def key_lists(r_idx: torch.Tensor, r_cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c_width = r_idx.shape[1]
            j = torch.arange(width + c_width, device=dev).unsqueeze(0)
            cw = w_cnt.unsqueeze(1)
            comp = torch.gather(r_idx, 1, (j - cw).clamp(0, max(c_width - 1, 0))) if c_width else torch.zeros_like(j)
            return torch.where(j < cw, w_start.unsqueeze(1) + j, comp), w_cnt + r_cnt

        if index is not None:
            sel, r_cnt = self.indexer.select_ranges(iq[0], iq[1], r_vis, index[0], meta_d[4], r_width, ops)
            idx, cnt = key_lists(sel + r_start.unsqueeze(1), r_cnt)
        else:  # every row visible
            idx, cnt = key_lists(r_start.unsqueeze(1) + torch.arange(r_width, device=dev), r_vis)
        keys = torch.cat([window_pool, rows_pool])
        return ops.sparse_attention_lists(q, keys, idx, cnt, self.attn_sink, self.head_dim**-0.5, out=out)

    def _compress_batched(
        self,
        comp: Compressor,
        proj: tuple[torch.Tensor, torch.Tensor],
        chunks: list[SeqChunk],
        offsets: list[tuple[int, int]],
        name: str,
        cache: PagedKVCache,
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, list[int]]:
        """Feed every chunk's projections to its compressor and store new rows; return one pool of every chunk's
        rows so far and the offset of each chunk's row 0 in it."""
        store = "rows" if name == "main" else "index"
        key = (self.layer_id, name)
        spans = [(a, b, c.start, c.state.replay_until // self.ratio) for c, (a, b) in zip(chunks, offsets)]
        done = comp.forward_many(proj[0], proj[1], spans, [c.state.buffers.get(key) for c in chunks], rope, ops, dtype)
        writes = []
        for chunk, (rows, first, buf) in zip(chunks, done):
            chunk.state.set_buffer(key, buf)
            if rows.shape[0]:
                writes.append((chunk.block_table, first, rows))
        cache.write_many(store, self.layer_id, writes)
        tables = [c.block_table for c in chunks]
        return cache.read_many(store, self.layer_id, tables, [c.end // self.ratio for c in chunks])

    def _compress(
        self,
        comp: Compressor,
        proj: tuple[torch.Tensor, torch.Tensor],
        chunk: SeqChunk,
        name: str,
        cache: PagedKVCache,
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Feed one sequence's projections to a compressor; store new rows; return all rows so far."""
        key = (self.layer_id, name)
        buf = chunk.state.buffers.get(key)
        skip = chunk.state.replay_until // self.ratio
        rows, first, buf = comp(proj[0], proj[1], chunk.start, buf, rope, ops, dtype, skip)
        chunk.state.set_buffer(key, buf)
        store = "rows" if name == "main" else "index"
        cache.write(store, self.layer_id, chunk.block_table, first, rows)
        return cache.read(store, self.layer_id, chunk.block_table, chunk.end // self.ratio)


def _pooled_decode(chunks: list[SeqChunk]) -> bool:
    """Whether a step is a decode step that ``decode_step`` runs: one new token per sequence, no bounded replay."""
    return bool(chunks) and all(c.length == 1 and c.state.replay_until <= c.start for c in chunks)


def _split_like(x: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x`` cut into consecutive pieces of the lengths of ``parts``."""
    out, o = [], 0
    for p in parts:
        out.append(x[o : o + p.shape[0]])
        o += p.shape[0]
    return out
