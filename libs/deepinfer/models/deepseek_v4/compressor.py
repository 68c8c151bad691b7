"""Compressors and the lightning indexer of DeepSeek-V4's compressed attention (docs/deepseek_v4.md: "Compressors",
"Lightning indexer").

A compressor pools every ``ratio`` tokens' fp32 projections into one row with a softmax gate (CSA windows overlap,
width 2m; HCA ones do not), normalises and rotates it; the indexer scores a CSA layer's compressed keys for each
query and keeps the top-k. ``attention.Attention`` owns and drives both.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable
from deepinfer.models.deepseek_v4.state import CompressorBuffer
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import to_device


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
        kv = ops.linear_fp32(x, self.wkv.weight)
        return kv, self.score(ops.linear_fp32(x, self.wgate.weight), positions, ops)

    def score(self, gate: torch.Tensor, positions: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The gate projection plus the position bias (fp32)."""
        return ops.compress_score(gate, self.ape, positions, self.ratio)

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
            cur_d, prev_d, has_prev = to_device(meta, dev)
            has_prev = has_prev[:, :1].bool().unsqueeze(-1)
            rows = self._rows(big_k, big_s, cur_d, prev_d, has_prev, to_device(w, dev), rope, ops, dtype)
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
        live: torch.Tensor | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Compressed rows ``w`` from the pending projections: group ``cur [k, m]`` (indices into ``kv`` /
        ``score``), with the overlapping CSA compressor also the first half of the previous group ``prev`` where
        ``has_prev [k, 1, 1]``; softmax pool (``ops.group_pool``; rows not ``live`` [k] are pooled as zeros, and a
        kernel skips them), norm, RoPE at position ``w · m`` (``cos_sin``: ``rope(w · m)`` when the caller has it),
        optional quantisation."""
        if live is None:
            live = torch.ones(cur.shape[0], dtype=torch.bool, device=cur.device)
        pooled = ops.group_pool(kv, score, cur, prev if self.overlap else None, has_prev.view(-1), live, self.dim)
        rows = self.norm(pooled.to(dtype), ops)
        cos, sin = cos_sin if cos_sin is not None else rope(w * self.ratio, ops)
        rows = ops.rope(rows, cos, sin, inplace=True)
        return self._quant(rows, ops) if self.quant_sim else rows

    def _quant(self, rows: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.rotate:  # indexer keys: Hadamard then FP4
            return ops.fp4_quant_sim(hadamard(rows), min(32, rows.shape[-1]))
        nope = rows[..., : -self.rd]
        return torch.cat([ops.act_quant_sim(nope, quant_block(nope.shape[-1])), rows[..., -self.rd :]], dim=-1)


def quant_block(dim: int) -> int:
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
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1), inplace=True)
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
        visible: torch.Tensor | None = None,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows each query keeps when query ``t`` sees rows ``0 .. visible_rows[t]`` of its sequence, stored at
        ``keys[start[t] + r]``: ``(rows [n, min(topk, width)]`` ascending, valid up to ``count [n]``; the entries past
        ``count`` are never read, ``ops.select_rows``). ``visible``: the mask ``[n, width]`` of those rows when the
        caller has it (a decode step's ``V4DecodePlan.indices``). ``paged``: the keys continue in a paged store
        (``ops.indexer_scores_ranges``)."""
        n = q.shape[0]
        k = min(self.topk, width)
        if n == 0 or k == 0:
            none = torch.zeros(n, 0, dtype=torch.long, device=q.device)
            return none, none.sum(1)
        if visible is None:
            visible = torch.arange(width, device=q.device).unsqueeze(0) < visible_rows.unsqueeze(1)
        scores = torch.where(visible, ops.indexer_scores_ranges(q, keys, w, start, width, paged=paged), float("-inf"))
        return ops.select_rows(scores, visible, k)

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
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1), inplace=True)
        if self.quant_sim:
            q = ops.fp4_quant_sim(hadamard(q), min(32, q.shape[-1]))
        w = self.weights_proj(x, ops).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        scores = ops.indexer_scores(q, keys, w).masked_fill(~visible, float("-inf"))
        k = min(self.topk, r)
        top = ops.topk_indices(scores, k)
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible


def _joined(a: torch.Tensor, b: torch.Tensor, dst: list[torch.Tensor], src: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat([a, b])`` left unfilled: its two copies are queued in ``dst`` / ``src`` (one ``_foreach_copy_`` of
    every sequence's pieces then takes a few launches instead of one per sequence)."""
    out = b.new_empty((a.shape[0] + b.shape[0], *b.shape[1:]), dtype=torch.promote_types(a.dtype, b.dtype))
    for part, lo in ((a, 0), (b, a.shape[0])):
        if part.shape[0]:
            dst.append(out[lo : lo + part.shape[0]])
            src.append(part)
    return out


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform over the last dim (a power of two): the indexer's rotation before its FP4
    round trip under ``DEEPINFER_QUANT_SIM`` (docs/deepseek_v4.md, "Lightning indexer")."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    y = x.float()
    h = 1
    while h < n:
        y = y.unflatten(-1, (-1, 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)
