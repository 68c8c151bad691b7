"""CSA2 attention of DeepSeek-V4.1 (MODEL_V41.md §2): shared-KV MQA with a sink over the window and, in
compressed layers, the rows the latest index source selected from the owner's compressed KV.

Per layer and token ``t``: ``qlat = q_norm(wq_a(x))``, ``q = rope(wq_b(qlat))`` (no per-head Q norm), window KV
``fp8(rope(kv_norm(wkv(x))))``. Keys: the layer's own window rows ``[t-W+1, t]`` plus, in compressed layers, the
owner's compressed rows chosen by the latest index source for the same token (a position may appear twice — its
own window row and an owner's compressed row — as in the reference). SWA-only layers use the main RoPE; every
compressed layer (ratio 1 too) the compress RoPE, for Q, window KV, compressed KV and index Q/K.

Layer roles (``layout.layer_specs``): Full layers compress, publish rows and index keys to the paged cache and
select; Reindex layers select again over the owner's index keys (restricted to the candidate source's blocks);
Reuse layers attend with the inherited selection. The per-step hand-off between layers is a :class:`StepContext`.

Cache representations (§2.5) are applied where the reference applies them when ``quant_sim`` is on (the
default for V4.1: they are part of the released model): FP8 window KV, NVFP4 compressed rows, MXFP4 index keys and
queries. The paged cache stores the dequantized values in the model dtype.

Each sequence attends alone (its keys and mask, one ``ops.sparse_attention`` call); projections, norms and the
output projection run once for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable
from deepinfer.models.deepseek_v4.state import PagedKVCache, SeqChunk
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.indexer import Compressor, Indexer
from deepinfer.models.deepseek_v41.layout import LayerSpec
from deepinfer.ops import Ops
from deepinfer.quant.cache import fp8_window_round, mxfp4_round, nvfp4_round

Identity: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # noqa: E731


@dataclass
class StepContext:
    """What one forward step's layers hand each other: the chunks, their rows in the batch, the paged cache, and
    per chunk the owner rows read so far and the latest selection / candidate masks (transient, never cached)."""

    chunks: list[SeqChunk]
    offsets: list[tuple[int, int]]
    positions: torch.Tensor
    cache: PagedKVCache | None
    rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (owner, chunk) -> rows so far
    index_keys: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    selection: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk -> bool [n, R] of the owner's rows
    candidates: dict[int, torch.Tensor | None] = field(default_factory=dict)


class Attention(nn.Module):
    """``layers.{i}.attn``: ``wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink`` (+ ``compressor``,
    ``indexer`` by role)."""

    def __init__(self, config: DeepseekV41TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        c = config
        self.spec, self.layer_id, self.ratio = spec, spec.index, spec.ratio
        self.n_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.window, self.o_groups, self.o_lora_rank = c.sliding_window, c.o_groups, c.o_lora_rank
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, fp8=True)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, fp8=True)
        self.wkv = Linear(c.hidden_size, self.head_dim, fp8=True)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank, fp8=True)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, c.hidden_size, fp8=True)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.compressor = Compressor(c, self.ratio) if spec.kind == "full" else None
        self.indexer = (
            Indexer(c, spec.kind == "full", spec.candidate_source, spec.uses_candidates)
            if spec.is_index_source
            else None
        )
        self.quant_sim = True

    def forward(self, x: torch.Tensor, ctx: StepContext, rope: RotaryTable, ops: Ops) -> torch.Tensor:
        """``x [T, hidden]`` (attention input, normed) of the step's tokens → ``[T, hidden]``."""
        n, h, d = x.shape[0], self.n_heads, self.head_dim
        fp8 = fp8_window_round if self.quant_sim else Identity
        cos, sin = rope(ctx.positions, ops)
        qlat = self.q_norm(self.wq_a(x, ops), ops)
        q = ops.rope(self.wq_b(qlat, ops).view(n, h, d), cos.unsqueeze(1), sin.unsqueeze(1))
        kv = fp8(ops.rope(self.kv_norm(self.wkv(x, ops), ops), cos, sin))
        proj = self.compressor.project(x, ops) if self.compressor is not None else None
        iq = iw = None
        if self.indexer is not None:
            iq, iw = self.indexer.queries(x, qlat, ops)
            iq = ops.rope(iq, cos.unsqueeze(1), sin.unsqueeze(1))
            iq = mxfp4_round(iq) if self.quant_sim else iq
        out = torch.empty_like(q)
        for i, (chunk, (a, b)) in enumerate(zip(ctx.chunks, ctx.offsets)):
            keys, mask = self._window(kv[a:b], chunk, ctx.positions[a:b])
            if self.ratio:
                if ctx.cache is None:
                    raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
                if proj is not None:
                    part = (proj[0][a:b], None if proj[1] is None else proj[1][a:b])
                    self._publish(part, chunk, i, ctx, rope, ops, kv.dtype)
                rows = self._owner_rows(ctx, i, chunk, "rows")
                if self.indexer is not None:
                    visible = (ctx.positions[a:b] + 1) // self.ratio
                    ikeys = self._owner_rows(ctx, i, chunk, "index")
                    ctx.selection[i], ctx.candidates[i] = self.indexer.select(
                        iq[a:b], iw[a:b], ikeys, visible, ctx.candidates.get(i), ops
                    )
                sel = ctx.selection.get(i)
                if sel is None or sel.shape != (b - a, rows.shape[0]):
                    raise ValueError(f"layer {self.layer_id} reuses a selection no index source made for this step")
                keys, mask = torch.cat([keys, rows.to(keys.dtype)]), torch.cat([mask, sel], dim=1)
            out[a:b] = ops.sparse_attention(q[a:b], keys, mask, self.attn_sink, d**-0.5)
        out = ops.rope(out, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
        g = self.o_groups
        z = ops.grouped_linear(out.view(n, g, -1), self.wo_a.weight.view(g, self.o_lora_rank, -1))
        return self.wo_b(z.flatten(1), ops)

    def publish(self, x: torch.Tensor, ctx: StepContext, rope: RotaryTable, ops: Ops) -> None:
        """A KV source's compressed rows and index keys for tokens that run no attention here (the prompt rows a
        bounded decoder replay skips): ``x [T, hidden]`` are their attention inputs, ``ctx`` their chunks."""
        if self.compressor is None:
            return
        if ctx.cache is None:
            raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
        proj = self.compressor.project(x, ops)
        for i, (chunk, (a, b)) in enumerate(zip(ctx.chunks, ctx.offsets)):
            part = (proj[0][a:b], None if proj[1] is None else proj[1][a:b])
            self._publish(part, chunk, i, ctx, rope, ops, x.dtype)

    def _window(self, kv: torch.Tensor, chunk: SeqChunk, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk's window keys (ring rows before it, then its own rows) and the mask ``[n, K]``; the ring then
        keeps the last ``W`` rows. A replay sees no rows before it started (``window_start``), a decoder layer none
        before the bounded decoder replay started (``decoder_start``)."""
        st, s, e, win = chunk.state, chunk.start, chunk.end, self.window
        ring = st.window(self.layer_id, win, self.head_dim, kv.dtype, kv.device)
        floor = max(st.window_start, st.decoder_start if self.spec.stage == "decoder" else 0)
        old = torch.arange(max(floor, s - win + 1, 0), s, device=kv.device)
        keys = torch.cat([ring[old % win], kv])
        kpos = torch.cat([old, positions])
        t = positions.unsqueeze(1)
        mask = (kpos.unsqueeze(0) <= t) & (kpos.unsqueeze(0) > t - win)
        keep = torch.arange(max(s, e - win), e, device=kv.device)
        ring[keep % win] = kv[keep - s]
        return keys, mask

    def _publish(
        self,
        proj: tuple[torch.Tensor, torch.Tensor | None],
        chunk: SeqChunk,
        i: int,
        ctx: StepContext,
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
    ) -> None:
        """Compress this chunk's tokens; write the completed rows and index keys to the paged cache."""
        key = (self.layer_id, "main")
        st = chunk.state
        skip = st.replay_until // self.ratio
        lat, first, st.buffers[key] = self.compressor.latents(
            proj[0], proj[1], chunk.start, st.buffers.get(key), ops, dtype, skip
        )
        if st.buffers[key] is None:
            del st.buffers[key]
        if lat.shape[0]:
            pos = torch.arange(first, first + lat.shape[0], device=lat.device) * self.ratio
            cos, sin = rope(pos, ops)
            rows = ops.rope(lat, cos, sin)
            ik = ops.rope(self.indexer.keys(lat, ops), cos, sin)
            if self.quant_sim:
                rows, ik = nvfp4_round(rows), mxfp4_round(ik)
            ctx.cache.write("rows", self.layer_id, chunk.block_table, first, rows)
            ctx.cache.write("index", self.layer_id, chunk.block_table, first, ik)
        ctx.rows.pop((self.layer_id, i), None)
        ctx.index_keys.pop((self.layer_id, i), None)

    def _owner_rows(self, ctx: StepContext, i: int, chunk: SeqChunk, kind: str) -> torch.Tensor:
        """Every row of the owner (this layer's KV source) up to the chunk's end, read once per step."""
        owner = self.spec.kv_source
        memo = ctx.rows if kind == "rows" else ctx.index_keys
        got = memo.get((owner, i))
        if got is None:
            got = memo[(owner, i)] = ctx.cache.read(kind, owner, chunk.block_table, chunk.end // self.ratio)
        return got
