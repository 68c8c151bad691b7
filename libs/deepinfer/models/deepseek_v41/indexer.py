"""CSA2 compressor and two-level indexer of DeepSeek-V4.1 (docs/deepseek_v41.md: "Compressors", "Two-level indexer").

Only KV-source (Full) layers own a compressor: ratio 1 is a per-token projection (``norm(wkv(x))`` in the input
dtype, no gate); ratio 2 pools non-overlapping token pairs with a channelwise softmax gate in fp32 (no position
bias, no overlap). Both give an unrotated latent per compressed row; the stored row is
``nvfp4(rope(latent, θc(first position of the group)))`` and the index key ``mxfp4(rope(k_norm(wk(latent)), …))``.

Index sources (Full and Reindex layers) score the owner's index keys for each query, ``Σ_h w_h · relu(q_h · k)``,
over the rows whose group is complete at or before the query (``j < (t + 1) // ratio``). The candidate source
(``candidate_source_layer_id``) also keeps the ``candidate_topk_blocks`` best blocks of ``candidate_block_size``
rows (block score = max, the block of the latest visible row always kept); later index sources score only those.

Top-k tie rule (documented, deterministic): equal scores go to the lower row index — for blocks, the lower block
index (``ops.topk_indices``). torch.topk's own choice among equal scores depends on the row width, so a full-sequence
reference and an incremental engine could otherwise select different rows where ReLU makes many scores exactly 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm
from deepinfer.models.deepseek_v4.state import CompressorBuffer
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import to_device


class Compressor(nn.Module):
    """``layers.{i}.attn.compressor``: ``wkv`` (and ``wgate`` for ratio 2) ``[head_dim, hidden]``, ``norm``."""

    overlap = False  # groups do not overlap (V4's overlapping compressors do)

    def __init__(self, config: DeepseekV41TextConfig, ratio: int) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"a CSA2 compressor has ratio 1 or 2, got {ratio}")
        self.ratio = ratio
        self.wkv = Linear(config.hidden_size, config.head_dim)
        self.wgate = Linear(config.hidden_size, config.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projections of a whole batch: ratio 1 the latent-to-be in ``x.dtype``; ratio 2 fp32 ``(kv, gate)``."""
        if self.wgate is None:
            return ops.linear(x, self.wkv.weight.to(x.dtype)), None
        xf = x.float()
        return ops.linear(xf, self.wkv.weight.float()), ops.linear(xf, self.wgate.weight.float())

    def latents_many(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        spans: list[tuple[int, int, int, int]],
        bufs: list[CompressorBuffer | None],
        ops: Ops,
        dtype: torch.dtype,
    ) -> tuple[list[tuple[torch.Tensor, int]], list[CompressorBuffer | None]]:
        """Ratio 2, several sequences in one batch: sequence ``i`` owns rows ``a .. b`` of the fp32 projections ``kv``
        / ``gate`` (``spans[i] = (a, b, start, skip_rows)``: its tokens ``start ..``) and the pending buffer
        ``bufs[i]`` (the first token of an open pair). Returns per sequence the unrotated latents of the rows it
        completes with the first row's index (rows below ``skip_rows`` are not computed: a bounded replay has them
        in the cache already), and its new pending buffer. One gather pools every completed pair of the batch."""
        m = self.ratio
        held = [b for b in bufs if b is not None]
        n_held = sum(b.kv.shape[0] for b in held)
        src_kv = torch.cat([b.kv for b in held] + [kv]) if held else kv
        src_gate = torch.cat([b.score for b in held] + [gate]) if held else gate
        group_idx, pend_idx, counts, firsts, pend = [], [], [], [], []
        off = 0  # where this sequence's buffer rows sit in src
        for (a, b, s, skip), buf in zip(spans, bufs):
            base = s if buf is None else buf.start
            end = s + b - a
            first, last = max(s // m, skip), end // m
            keep = max(last * m, base)

            def where(p: torch.Tensor, a: int = a, s: int = s, base: int = base, off: int = off) -> torch.Tensor:
                return torch.where(p < s, off + p - base, n_held + a + p - s)

            group_idx.append(where(torch.arange(first * m, max(last, first) * m)))
            pend_idx.append(where(torch.arange(keep, end)))
            counts.append(max(last - first, 0))
            firsts.append(first)
            pend.append((keep, end - keep))
            off += 0 if buf is None else buf.kv.shape[0]
        dev = kv.device
        gi = to_device(torch.cat(group_idx), dev)
        pi = to_device(torch.cat(pend_idx), dev)
        if gi.numel():
            k, g = src_kv[gi].unflatten(0, (-1, m)), src_gate[gi].unflatten(0, (-1, m))
            rows = self.norm(ops.softmax_pool(k, g).to(dtype), ops)
        else:
            rows = kv.new_zeros(0, kv.shape[-1], dtype=dtype)
        pk, pg = src_kv[pi], src_gate[pi]
        sizes = [n for _, n in pend]
        new_bufs = [
            CompressorBuffer(kv=k_, score=g_, start=keep) if n else None
            for (keep, n), k_, g_ in zip(pend, pk.split(sizes), pg.split(sizes))
        ]
        return list(zip(rows.split(counts), firsts)), new_bufs


class Indexer(nn.Module):
    """``layers.{i}.attn.indexer``: ``wq_b`` and ``weights_proj`` in every index source; ``wk`` and ``k_norm`` in
    the KV sources (the index keys come from the compressor's latent)."""

    def __init__(self, config: DeepseekV41TextConfig, owns_keys: bool, candidate_source: bool, uses_candidates: bool):
        super().__init__()
        c = config
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.block_size, self.topk_blocks = c.candidate_block_size, c.candidate_topk_blocks
        self.candidate_source, self.uses_candidates = candidate_source, uses_candidates
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, fp8=True)
        self.weights_proj = Linear(c.hidden_size, self.n_heads)
        self.wk = Linear(c.head_dim, self.head_dim) if owns_keys else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if owns_keys else None

    def keys(self, latent: torch.Tensor, ops: Ops, rowwise: bool = False) -> torch.Tensor:
        """Unrotated index keys ``[k, index_head_dim]`` of compressed latents. ``rowwise``: ``wk`` one row at a time
        (``rowwise_linear``: each row's key whatever rows are computed with it; a ratio-2 KV source's decode step
        computes every sequence's key, the per-sequence path only the completed ones)."""
        if rowwise and self.wk.weight.dtype != torch.float8_e4m3fn:
            return self.k_norm(rowwise_linear(latent, self.wk.weight), ops)
        return self.k_norm(self.wk(latent, ops), ops)

    def queries(self, x: torch.Tensor, qlat: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """Unrotated index queries ``[T, heads, dim]`` and their fp32 head weights ``[T, heads]`` (scaled)."""
        q = self.wq_b(qlat, ops).view(x.shape[0], self.n_heads, self.head_dim)
        w = self.weights_proj(x, ops).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w

    def select(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
        candidates: torch.Tensor | None,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows each query attends to: a bool mask ``[n, R]`` over the owner's ``R`` rows, and (the candidate
        source) the candidate mask later index sources restrict to. ``visible [n]`` counts each query's rows."""
        r = keys.shape[0]
        allowed = torch.arange(r, device=q.device).unsqueeze(0) < visible.unsqueeze(1)
        if r == 0:
            return allowed, allowed if self.candidate_source else candidates
        scores = ops.indexer_scores(q, keys, w).masked_fill(~allowed, float("-inf"))
        if self.candidate_source:
            candidates = candidate_blocks(scores, visible, self.topk_blocks, self.block_size, ops) & allowed
        elif self.uses_candidates:
            if candidates is None or candidates.shape != scores.shape:
                raise ValueError("a candidate-restricted index source needs the candidate source's selection")
            scores = scores.masked_fill(~candidates, float("-inf"))
        k = min(self.topk, r)
        top = ops.topk_indices(scores, k)
        chosen = torch.zeros_like(allowed).scatter_(1, top, True)
        return chosen & torch.isfinite(scores), candidates


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int, ops: Ops
) -> torch.Tensor:
    """Rows of the best ``topk_blocks`` blocks of ``block`` rows per query (block score = max row score; the block
    of the latest visible row is always kept; only blocks with a finite score count)."""
    width = scores.shape[-1]
    b = F.pad(scores, (0, -width % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)
    last = torch.div(visible - 1, block, rounding_mode="floor").unsqueeze(1)
    ids = torch.arange(b.shape[-1], device=scores.device).unsqueeze(0)
    b = b.masked_fill(ids == last, float("inf"))
    top = ops.topk_indices(b, min(topk_blocks, b.shape[-1]))
    keep = torch.zeros_like(b, dtype=torch.bool).scatter_(1, top, b.gather(1, top) > float("-inf"))
    return keep.unsqueeze(-1).expand(*keep.shape, block).flatten(-2)[:, :width]  # no host sync (CUDA graphs)


def rowwise_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` as a batch of one-row products: a row's result does not depend on the rows computed with it (a
    GEMM's blocking, on the CPU and in cuBLAS, changes with the number of rows, and so does its rounding)."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[0])
    wt = w.to(x.dtype).t().unsqueeze(0).expand(x.shape[0], -1, -1)
    return torch.bmm(x.unsqueeze(1), wt).squeeze(1)
