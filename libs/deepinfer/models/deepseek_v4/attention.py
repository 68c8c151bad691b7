"""Shared-KV MQA with sink, and its compressed branches (MODEL_V4.md §2.4–§2.8).

Every layer attends to the window rows (the last ``W`` raw KV rows, the current token included);
HCA layers add every complete compressed row, CSA layers add the indexer's top-k compressed rows.
The long-term rows go to the paged cache, the window and the compressor buffers to the sequence.

Two paths compute the same attention. With batch-invariant ops each sequence attends alone (``_attend_one``: its
keys and mask, one ``ops.sparse_attention`` call per sequence), which keeps that mode's results what they were. Every
other op set takes the batched path (``_attend_batched``): the state bookkeeping stays per sequence (window ring,
compressor buffers, page writes: cheap views and copies), while the work runs once for the whole batch: one pool of
window rows, one gather of every sequence's compressed rows (``PagedKVCache.read_many``), one indexer scoring and
top-k over per-query row ranges, and one ``ops.sparse_attention_lists`` over per-query key lists (window rows by
position, then compressed rows by index).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable
from deepinfer.models.deepseek_v4.state import CompressorBuffer, PagedKVCache, SeqChunk
from deepinfer.ops import Ops
from deepinfer.ops.reference import hadamard


class Compressor(nn.Module):
    """Softmax-gated pooling of every ``ratio`` tokens into one row; CSA windows overlap (width 2m)."""

    def __init__(self, config: DeepseekV4Config, ratio: int, dim: int, overlap: bool, rotate: bool) -> None:
        super().__init__()
        coff = 2 if overlap else 1
        self.ratio, self.dim, self.overlap, self.rotate = ratio, dim, overlap, rotate
        self.rd = config.qk_rope_head_dim
        self.wkv = Linear(config.hidden_size, coff * dim)
        self.wgate = Linear(config.hidden_size, coff * dim)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim), requires_grad=False)
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.quant_sim = False

    def project(self, x: torch.Tensor, positions: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 projections of a whole batch: ``kv`` and ``score`` (gate + position bias)."""
        xf = x.float()
        kv = ops.linear(xf, self.wkv.weight.float())
        score = ops.linear(xf, self.wgate.weight.float()) + self.ape.float()[positions % self.ratio]
        return kv, score

    def forward(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        start: int,
        buf: CompressorBuffer | None,
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
        skip_rows: int = 0,
    ) -> tuple[torch.Tensor, int, CompressorBuffer]:
        """Consume the projections of tokens ``start .. start+len(kv)``; return the rows completed,
        the first row's index and the new buffer. Rows below ``skip_rows`` are not computed (a bounded
        replay: they are in the cache already, and their windows may reach before the replay's start)."""
        m, d, n, dev = self.ratio, self.dim, kv.shape[0], kv.device
        if buf is not None:
            kv, score, base = torch.cat([buf.kv, kv]), torch.cat([buf.score, score]), buf.start
        else:
            base = start
        end = start + n
        first, last = max(start // m, skip_rows), end // m
        if last > first:
            w = torch.arange(first, last, device=dev)
            cur = w.unsqueeze(1) * m + torch.arange(m, device=dev) - base  # [k, m]
            rows = self._rows(kv, score, cur, (cur - m).clamp_min(0), (w > 0).view(-1, 1, 1), w, rope, ops, dtype)
        else:
            rows = kv.new_zeros(0, d, dtype=dtype)
        keep = max(last - (1 if self.overlap else 0), 0) * m
        keep = max(keep, base)
        kv, score = kv[keep - base :], score[keep - base :]
        if buf is None:  # views of the whole batch's projections: keep only this sequence's rows alive
            kv, score = kv.clone(), score.clone()
        return rows, first, CompressorBuffer(kv=kv, score=score, start=keep)

    def forward_many(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        spans: list[tuple[int, int, int, int]],
        bufs: list[CompressorBuffer | None],
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
    ) -> list[tuple[torch.Tensor, int, CompressorBuffer]]:
        """``forward`` of several sequences: sequence ``i`` owns rows ``a .. b`` of the batch projections ``kv`` and
        ``score`` (``spans[i] = (a, b, start, skip_rows)``) and the buffer ``bufs[i]``. The buffers advance one by one;
        the rows completed by all sequences are gathered, pooled, normalised and rotated as one batch."""
        m, d, dev = self.ratio, self.dim, kv.device
        none = kv.new_zeros(0, d, dtype=dtype)  # the rows of every sequence that completes none (never written to)
        out: list[list] = []
        jobs = []
        dst: list[torch.Tensor] = []  # each buffer + new rows: filled by one batched copy after the loop
        src: list[torch.Tensor] = []
        for (a, b, start, skip), buf in zip(spans, bufs):
            k_i, s_i, base = kv[a:b], score[a:b], start
            if buf is not None:
                k_i, s_i, base = _joined(buf.kv, k_i, dst, src), _joined(buf.score, s_i, dst, src), buf.start
            first, last = max(start // m, skip), (start + b - a) // m
            if last > first:
                jobs.append((len(out), k_i, s_i, base, first, last))
            keep = max(max(last - (1 if self.overlap else 0), 0) * m, base)
            nk, ns = k_i[keep - base :], s_i[keep - base :]
            if buf is None:  # views of the whole batch's projections: keep only this sequence's rows alive
                nk, ns = nk.clone(), ns.clone()
            out.append([none, first, CompressorBuffer(kv=nk, score=ns, start=keep)])
        if dst:
            torch._foreach_copy_(dst, src)
        if jobs:
            big_k = torch.cat([j[1] for j in jobs]) if len(jobs) > 1 else jobs[0][1]
            big_s = torch.cat([j[2] for j in jobs]) if len(jobs) > 1 else jobs[0][2]
            cur, prev, ws, off = [], [], [], 0
            for _, k_i, _, base, first, last in jobs:  # host-side indices into the concatenated buffers
                w = torch.arange(first, last)
                c = w.unsqueeze(1) * m + torch.arange(m) - base
                cur.append(c + off)
                prev.append((c - m).clamp_min(0) + off)
                ws.append(w)
                off += k_i.shape[0]
            w = torch.cat(ws)
            meta = torch.stack([torch.cat(cur), torch.cat(prev), (w > 0).long().unsqueeze(1).expand(-1, m)])
            cur_d, prev_d, has_prev = meta.to(dev, non_blocking=True)
            has_prev = has_prev[:, :1].bool().unsqueeze(-1)
            rows = self._rows(big_k, big_s, cur_d, prev_d, has_prev, w.to(dev, non_blocking=True), rope, ops, dtype)
            for job, part in zip(jobs, rows.split([j[5] - j[4] for j in jobs])):
                out[job[0]][0] = part
        return [(r, f, nb) for r, f, nb in out]

    def _rows(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        cur: torch.Tensor,
        prev: torch.Tensor,
        has_prev: torch.Tensor,
        w: torch.Tensor,
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Compressed rows ``w`` from the pending projections: group ``cur [k, m]`` (indices into ``kv`` /
        ``score``), with the overlapping CSA compressor also the first half of the previous group ``prev`` where
        ``has_prev [k, 1, 1]``; softmax pool, norm, RoPE at position ``w · m``, optional quantisation."""
        d = self.dim
        if self.overlap:
            kp = torch.where(has_prev, kv[prev][..., :d], 0.0)
            sp = torch.where(has_prev, score[prev][..., :d], float("-inf"))
            k_all = torch.cat([kp, kv[cur][..., d:]], dim=1)
            s_all = torch.cat([sp, score[cur][..., d:]], dim=1)
        else:
            k_all, s_all = kv[cur], score[cur]
        rows = self.norm(ops.softmax_pool(k_all, s_all).to(dtype), ops)
        cos, sin = rope(w * self.ratio, ops)
        rows = ops.rope(rows, cos, sin)
        return self._quant(rows, ops) if self.quant_sim else rows

    def _quant(self, rows: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.rotate:  # indexer keys: Hadamard then FP4
            return ops.fp4_quant_sim(hadamard(rows), min(32, rows.shape[-1]))
        nope = rows[..., : -self.rd]
        return torch.cat([ops.act_quant_sim(nope, _qblock(nope.shape[-1])), rows[..., -self.rd :]], dim=-1)


def _qblock(dim: int) -> int:
    """The reference quantises the 448 nope dims in blocks of 64; tiny models fall back to a divisor."""
    for b in (64, 32, 16, 8):
        if dim % b == 0:
            return b
    return dim


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: scores compressed rows per query and keeps the top-k."""

    def __init__(self, config: DeepseekV4Config, ratio: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.ratio = ratio
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, fp8=True)
        self.weights_proj = Linear(config.hidden_size, self.n_heads)
        self.compressor = Compressor(config, ratio, self.head_dim, overlap=True, rotate=True)
        self.quant_sim = False

    def queries(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries ``[n, h, d]`` and their head weights ``[n, h]`` (fp32, scaled)."""
        n = x.shape[0]
        q = self.wq_b(qr, ops).view(n, self.n_heads, self.head_dim)
        cos, sin = rope(positions, ops)
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        if self.quant_sim:
            q = ops.fp4_quant_sim(hadamard(q), min(32, q.shape[-1]))
        w = self.weights_proj(x, ops).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w

    def select_ranges(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        visible_rows: torch.Tensor,
        keys: torch.Tensor,
        start: torch.Tensor,
        width: int,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows each query keeps when query ``t`` sees rows ``0 .. visible_rows[t]`` of its sequence, stored at
        ``keys[start[t] + r]``: ``(rows [n, min(topk, width)]`` ascending, valid up to ``count [n]``)."""
        n = q.shape[0]
        k = min(self.topk, width)
        if n == 0 or k == 0:
            none = torch.zeros(n, 0, dtype=torch.long, device=q.device)
            return none, none.sum(1)
        visible = torch.arange(width, device=q.device).unsqueeze(0) < visible_rows.unsqueeze(1)
        scores = ops.indexer_scores_ranges(q, keys, w, start, width).masked_fill(~visible, float("-inf"))
        top = ops.topk_indices(scores, k)
        chosen = torch.zeros_like(visible).scatter_(1, top, True) & visible
        rows = torch.sort((~chosen).to(torch.uint8), dim=1, stable=True).indices[:, :k]
        return rows, chosen.sum(1)

    def select(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        rope: RotaryTable,
        ops: Ops,
    ) -> torch.Tensor:
        """Boolean ``[n, R]`` mask of the rows each query keeps."""
        n, r = x.shape[0], keys.shape[0]
        visible = torch.arange(r, device=x.device).unsqueeze(0) < ((positions + 1) // self.ratio).unsqueeze(1)
        if r == 0:
            return visible
        q = self.wq_b(qr, ops).view(n, self.n_heads, self.head_dim)
        cos, sin = rope(positions, ops)
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        if self.quant_sim:
            q = ops.fp4_quant_sim(hadamard(q), min(32, q.shape[-1]))
        w = self.weights_proj(x, ops).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        scores = ops.indexer_scores(q, keys, w).masked_fill(~visible, float("-inf"))
        k = min(self.topk, r)
        top = ops.topk_indices(scores, k)
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible


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
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, c.hidden_size, fp8=True)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.compressor = None
        self.indexer = None
        if self.ratio:
            self.compressor = Compressor(c, self.ratio, self.head_dim, overlap=self.kind == "csa", rotate=False)
            if self.kind == "csa":
                self.indexer = Indexer(c, self.ratio)
        self.quant_sim = False

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
        qr = self.q_norm(self.wq_a(x, ops), ops)
        q = self.wq_b(qr, ops).view(n_tok, h, d)
        q = ops.rms_norm(q, None, self.eps)
        cos, sin = rope(positions, ops)
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        kv = ops.rope(self.kv_norm(self.wkv(x, ops), ops), cos, sin)
        if self.quant_sim:
            kv = torch.cat([ops.act_quant_sim(kv[:, :-rd], _qblock(d - rd)), kv[:, -rd:]], dim=-1)
        t = {"x": x, "qr": qr, "q": q, "kv": kv, "cos": cos, "sin": sin}
        if self.compressor is not None:
            t["main_kv"], t["main_score"] = self.compressor.project(x, positions, ops)
        if self.indexer is not None:
            t["index_kv"], t["index_score"] = self.indexer.compressor.project(x, positions, ops)
            if not ops.batch_invariant:
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
    ) -> torch.Tensor:
        """The attention output ``[T, H, d]`` of ``project``'s tensors; reads and advances each sequence's state."""
        x, qr, q, kv = t["x"], t["qr"], t["q"], t["kv"]
        proj = {k: (t[f"{k}_kv"], t[f"{k}_score"]) for k in ("main", "index") if f"{k}_kv" in t}
        if ops.batch_invariant:
            out = torch.empty_like(q)
            for chunk, (a, b) in zip(chunks, offsets):
                part = {k: (v[0][a:b], v[1][a:b]) for k, v in proj.items()}
                out[a:b] = self._attend_one(
                    x[a:b], qr[a:b], q[a:b], kv[a:b], positions[a:b], part, chunk, cache, rope, ops
                )
            return out
        iq = (t["iq"], t["iw"]) if "iq" in t else None
        return self._attend_batched(x, q, kv, iq, proj, chunks, offsets, cache, rope, ops)

    def output(self, out: torch.Tensor, t: dict[str, torch.Tensor], ops: Ops) -> torch.Tensor:
        """Inverse RoPE, then the grouped ``wo_a`` and ``wo_b``: ``[T, hidden]``."""
        n_tok, cos, sin = out.shape[0], t["cos"], t["sin"]
        out = ops.rope(out, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
        g = self.o_groups
        z = ops.grouped_linear(out.view(n_tok, g, -1), self.wo_a.weight.view(g, self.o_lora_rank, -1))
        return self.wo_b(z.flatten(1), ops)

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
        kpos = torch.cat([old, positions])
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
    ) -> torch.Tensor:
        """Attention of every chunk at once (module docstring); the same keys and masks as ``_attend_one``. ``iq``: the
        indexer's queries and head weights (CSA layers)."""
        win, dev, n_tok = self.window, x.device, x.shape[0]
        # -- the window: each chunk's old rows (ring slots, in position order) then its new rows, in one pool
        pieces, lo, woff, o = [], [], [], 0
        for chunk, (a, b) in zip(chunks, offsets):
            st, s = chunk.state, chunk.start
            ring = st.window(self.layer_id, win, self.head_dim, kv.dtype, kv.device)
            first = max(st.window_start, s - win + 1, 0)  # a replay sees no older rows
            pieces += _ring_span(ring, first, s - first) + [kv[a:b]]
            lo.append(first)
            woff.append(o)
            o += s - first + b - a
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
        # -- per-token metadata (host-side ints, one copy to the device)
        lens = [b - a for a, b in offsets]
        cid = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens, dtype=torch.long))
        pos = torch.cat([torch.arange(c.start, c.end) for c in chunks]) if chunks else torch.zeros(0, dtype=torch.long)
        lo_t = torch.tensor(lo, dtype=torch.long)[cid]
        w_first = torch.maximum(pos - win + 1, lo_t)
        meta = [torch.tensor(woff, dtype=torch.long)[cid] + (w_first - lo_t), pos - w_first + 1]
        width = int(meta[1].max()) if n_tok else 0
        if self.compressor is None:
            w_start, w_cnt = torch.stack(meta).to(dev, non_blocking=True)
            idx = w_start.unsqueeze(1) + torch.arange(width, device=dev)
            return ops.sparse_attention_lists(q, window_pool, idx, w_cnt, self.attn_sink, self.head_dim**-0.5)
        if cache is None:
            raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
        m = self.ratio
        rows_pool, roff = self._compress_batched(self.compressor, proj["main"], chunks, offsets, "main", cache, rope,
                                                 ops, kv.dtype)  # fmt: skip
        counts = [c.end // m for c in chunks]
        visible = (pos + 1) // m
        meta += [torch.tensor(roff, dtype=torch.long)[cid] + window_pool.shape[0], visible]
        if self.indexer is not None:
            ipool, ioff = self._compress_batched(self.indexer.compressor, proj["index"], chunks, offsets, "index",
                                                 cache, rope, ops, kv.dtype)  # fmt: skip
            meta.append(torch.tensor(ioff, dtype=torch.long)[cid])
        meta_d = torch.stack(meta).to(dev, non_blocking=True)
        w_start, w_cnt, r_start, r_vis = meta_d[0], meta_d[1], meta_d[2], meta_d[3]
        r_width = max(counts, default=0)
        if self.indexer is not None:
            sel, r_cnt = self.indexer.select_ranges(iq[0], iq[1], r_vis, ipool, meta_d[4], r_width, ops)
            r_idx = sel + r_start.unsqueeze(1)
            c_width = sel.shape[1]
        else:
            r_cnt, c_width = r_vis, r_width
            r_idx = r_start.unsqueeze(1) + torch.arange(c_width, device=dev)
        keys = torch.cat([window_pool, rows_pool])
        j = torch.arange(width + c_width, device=dev).unsqueeze(0)
        cw = w_cnt.unsqueeze(1)
        comp = torch.gather(r_idx, 1, (j - cw).clamp(0, max(c_width - 1, 0))) if c_width else torch.zeros_like(j)
        idx = torch.where(j < cw, w_start.unsqueeze(1) + j, comp)
        return ops.sparse_attention_lists(q, keys, idx, w_cnt + r_cnt, self.attn_sink, self.head_dim**-0.5)

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
            chunk.state.buffers[key] = buf
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
        rows, first, chunk.state.buffers[key] = comp(proj[0], proj[1], chunk.start, buf, rope, ops, dtype, skip)
        store = "rows" if name == "main" else "index"
        cache.write(store, self.layer_id, chunk.block_table, first, rows)
        return cache.read(store, self.layer_id, chunk.block_table, chunk.end // self.ratio)


def _joined(a: torch.Tensor, b: torch.Tensor, dst: list[torch.Tensor], src: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([a, b])`` left unfilled: its two copies are queued in ``dst`` / ``src`` (one ``_foreach_copy_`` of
    every sequence's pieces then takes a few launches instead of one per sequence)."""
    out = b.new_empty((a.shape[0] + b.shape[0], *b.shape[1:]), dtype=torch.promote_types(a.dtype, b.dtype))
    for part, lo in ((a, 0), (b, a.shape[0])):
        if part.shape[0]:
            dst.append(out[lo : lo + part.shape[0]])
            src.append(part)
    return out


def _ring_span(ring: torch.Tensor, first: int, count: int) -> list[torch.Tensor]:
    """Views of the ring slots of positions ``first .. first + count`` in position order (one or two pieces)."""
    if count <= 0:
        return []
    size = ring.shape[0]
    a = first % size
    if a + count <= size:
        return [ring[a : a + count]]
    return [ring[a:], ring[: a + count - size]]


def _split_like(x: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``x`` cut into consecutive pieces of the lengths of ``parts``."""
    out, o = [], 0
    for p in parts:
        out.append(x[o : o + p.shape[0]])
        o += p.shape[0]
    return out
