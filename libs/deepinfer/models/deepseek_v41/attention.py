"""CSA2 attention of DeepSeek-V4.1 (docs/deepseek_v41.md ("CSA2 attention")): shared-KV MQA with a sink over the window
and, in compressed layers, the rows the latest index source selected from the owner's compressed KV.

Per layer and token ``t``: ``qlat = q_norm(wq_a(x))``, ``q = rope(wq_b(qlat))`` (no per-head Q norm), window KV
``fp8(rope(kv_norm(wkv(x))))``. Keys: the layer's own window rows ``[t-W+1, t]`` plus, in compressed layers, the
owner's compressed rows chosen by the latest index source for the same token (a position may appear twice — its
own window row and an owner's compressed row — as in the reference). SWA-only layers use the main RoPE; every
compressed layer (ratio 1 too) the compress RoPE, for Q, window KV, compressed KV and index Q/K.

Layer roles (``layout.layer_specs``): Full layers compress, publish rows and index keys to the paged cache and
select; Reindex layers select again over the owner's index keys (restricted to the candidate source's blocks);
Reuse layers attend with the inherited selection. The per-step hand-off between layers is a :class:`StepContext`.

Cache representations (docs/deepseek_v41.md ("Cache formats")) are applied where the reference applies them when
``quant_sim`` is on (the default for V4.1: they are part of the released model): FP8 window KV, NVFP4 compressed rows,
MXFP4 index keys and queries. The paged cache stores the dequantized values in the model dtype.

Each sequence attends alone (its keys and mask, one ``ops.sparse_attention`` call; the batch-invariant path) or the
batch attends at once (``attention_batched``); projections, norms and the output projection run once for the whole
batch. A layer is ``project`` (pure, fixed shapes) → ``attend`` (state bookkeeping) → ``output`` (pure). A decode step
(one token per sequence) on the model's ``StatePool`` takes ``decode_step.attend``: the whole bookkeeping in fixed
shapes from a ``V41DecodePlan`` made once per step (``StepContext.plan``), what the decode CUDA graph (``graphs``)
captures with the rest of the step.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4.forward_batch import SeqChunk
from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable, join_rows, rows_forward
from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.models.deepseek_v41 import decode_step
from deepinfer.models.deepseek_v41.attention_batched import attend_batched
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.indexer import Compressor, Indexer
from deepinfer.models.deepseek_v41.layout import LayerSpec
from deepinfer.models.deepseek_v41.step_context import StepContext
from deepinfer.ops import Ops
from deepinfer.parallel.tensor_parallel import reduce_output
from deepinfer.runtime.host_copy import to_device


class SharedKVAttention(nn.Module):
    """The projections every V4.1 attention has (backbone layers and DSpark stages): ``wq_a, q_norm, wq_b, wkv,
    kv_norm, wo_a, wo_b, attn_sink``, with FP8 window KV when ``quant_sim`` (the released model's default)."""

    def __init__(self, config: DeepseekV41TextConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.o_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, fp8=True)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, fp8=True)
        self.wkv = Linear(c.hidden_size, self.head_dim, fp8=True)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank, fp8=True)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, c.hidden_size, fp8=True)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads), requires_grad=False)
        self.quant_sim = True
        self.tp = None  # this layer's tensor-parallel group: its heads only (``parallel.tensor_parallel``)

    def join_projections(self) -> None:
        """``wq_a`` and ``wkv`` (both read the layer's input) as one GEMM (``layers.join_rows``; a backend's
        ``prepare_weights``)."""
        join_rows([self.wq_a, self.wkv])

    def window_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Rotated window KV rows ``[T, d]``, FP8-rounded when ``quant_sim``."""
        return self._window_kv(self.wkv(x, ops), cos, sin, ops)

    def queries_and_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Q-LoRA latent ``[T, q_lora_rank]``, the rotated queries ``[T, H, d]`` (no per-head norm) and the window
        KV rows (``window_kv``) of one input, its two projections one GEMM where they are joined."""
        qa, kva = rows_forward(x, [self.wq_a, self.wkv], ops)
        return (*self._queries(qa, cos, sin, ops), self._window_kv(kva, cos, sin, ops))

    def _queries(
        self, qa: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Ops
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qlat = self.q_norm(qa, ops)
        q = self.wq_b(qlat, ops).view(qa.shape[0], self.n_heads, self.head_dim)
        return qlat, ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1), inplace=True)

    def _window_kv(self, kva: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Ops) -> torch.Tensor:
        kv = ops.rope(self.kv_norm(kva, ops), cos, sin, inplace=True)
        return ops.cache_round(kv, "fp8") if self.quant_sim else kv

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Attention output ``[T, H, d]`` → ``[T, hidden]``: inverse RoPE, grouped ``wo_a``, ``wo_b``."""
        out = ops.rope(out, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True, inplace=True)
        z = self.wo_a.grouped(out.view(out.shape[0], self.o_groups, -1), ops)
        return reduce_output(self, self.wo_b(z.flatten(1), ops))


class Attention(SharedKVAttention):
    """``layers.{i}.attn``: the shared projections (+ ``compressor``, ``indexer`` by role)."""

    def __init__(self, config: DeepseekV41TextConfig, spec: LayerSpec) -> None:
        super().__init__(config)
        c = config
        self.spec, self.layer_id, self.ratio, self.window = spec, spec.index, spec.ratio, c.sliding_window
        self.state_pool: StatePool | None = None  # the model's, for decode steps (decode_step.py)
        self.capture: dict | None = None  # a speculative verify step: the ratio-2 compressor's projections, copied
        self.compressor = Compressor(c, self.ratio) if spec.kind == "full" else None
        self.indexer = (
            Indexer(c, spec.kind == "full", spec.candidate_source, spec.uses_candidates)
            if spec.is_index_source
            else None
        )

    def forward(self, x: torch.Tensor, ctx: StepContext, rope: RotaryTable, ops: Ops) -> torch.Tensor:
        """``x [T, hidden]`` (attention input, normed) of the step's tokens → ``[T, hidden]``."""
        t = self.project(x, ctx.positions, rope, ops)
        return self.output(self.attend(t, ctx, rope, ops), t["cos"], t["sin"], ops)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, ops: Ops) -> dict[str, torch.Tensor]:
        """Everything before the state is touched, one row per token: ``cos`` / ``sin``, the rotated queries ``q``, the
        window KV ``kv``, the compressor's projections (``ckv`` and, ratio 2, ``cgate``) and the rotated index queries
        ``iq`` with their weights ``iw``. A pure function of its inputs (the decode CUDA graphs capture it)."""
        cos, sin = rope(positions, ops)
        qlat, q, kv = self.queries_and_kv(x, cos, sin, ops)
        t = {"cos": cos, "sin": sin, "q": q, "kv": kv}
        if self.compressor is not None:
            t["ckv"], gate = self.compressor.project(x, ops)
            if gate is not None:
                t["cgate"] = gate
        if self.indexer is not None:
            iq, t["iw"] = self.indexer.queries(x, qlat, ops)
            iq = ops.rope(iq, cos.unsqueeze(1), sin.unsqueeze(1))
            t["iq"] = ops.cache_round(iq, "mxfp4") if self.quant_sim else iq
        return t

    def attend(
        self, t: dict[str, torch.Tensor], ctx: StepContext, rope: RotaryTable, ops: Ops, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention output ``[T, H, d]`` of ``project``'s tensors: publishes the compressed rows and index keys,
        selects, attends; reads and advances each sequence's state (the eager part of a graphed decode step).
        ``out``: written there and returned (a piecewise CUDA graph reads it from a fixed address)."""
        if self.ratio and ctx.cache is None:
            raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
        q, kv, iq, iw = t["q"], t["kv"], t.get("iq"), t.get("iw")
        pool = self.state_pool
        if pool is not None and not ops.invariant_by_sequence and decode_step.pooled_decode(ctx.chunks):
            if ctx.plan is None:
                ctx.plan = decode_step.V41DecodePlan.of(pool, ctx.cache, self.window, ctx.chunks)
            res = decode_step.attend(self, t, ctx.plan, rope, ops)
            return res if out is None else out.copy_(res)
        if "ckv" in t:
            if self.capture is not None and "cgate" in t:  # (copies: piecewise graphs reuse their buffers)
                self.capture["main"] = (t["ckv"].clone(), t["cgate"].clone())
            self._publish((t["ckv"], t.get("cgate")), ctx, rope, ops, kv.dtype)
        if ops.invariant_by_sequence:
            res = self._attend_each(q, kv, iq, iw, ctx, ops)
            return res if out is None else out.copy_(res)
        return attend_batched(self, q, kv, iq, iw, ctx, ops, out)

    def pending(self) -> list[tuple[str, Compressor]]:
        """The compressors that keep pending rows between steps (a ratio-2 KV source's), by name (speculative
        rollback: ``deepseek_v4.speculative``)."""
        return [("main", self.compressor)] if self.compressor is not None and self.ratio > 1 else []

    def keep_pending(self, state: SequenceState, key: tuple[int, str], buf: CompressorBuffer) -> None:
        """Store a compressor's pending rows (a speculative rollback's) as a step does: none kept when empty."""
        _keep_buffer(state, key, buf if buf.kv.shape[0] else None, buf.start, buf.kv)

    def pool_specs(self) -> tuple[dict, dict]:
        """This layer's window ring ``{layer: (rows, dim)}`` and, a ratio-2 KV source, its compressor ring
        ``{(layer, "main"): (cap, dim, ratio, overlap)}`` (``StatePool.register``; ``decode_step``)."""
        bufs = {}
        if self.compressor is not None and self.ratio > 1:
            bufs[(self.layer_id, "main")] = (self.ratio, self.head_dim, self.ratio, False)
        return {self.layer_id: (self.window, self.head_dim)}, bufs

    def ring_sources(self) -> dict[tuple[int, str], tuple[str, ...]]:
        """What a decode step writes to a ring of ``pool_specs`` as is, by ring: a ratio-2 compressor's ring gets the
        step's projections (``project``'s ``ckv``, ``cgate``; a verify step rolls it back from them:
        ``deepseek_v4.verify_rings``)."""
        return {(self.layer_id, "main"): ("ckv", "cgate")} if self.compressor is not None and self.ratio > 1 else {}

    def _attend_each(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        iq: torch.Tensor | None,
        iw: torch.Tensor | None,
        ctx: StepContext,
        ops: Ops,
    ) -> torch.Tensor:
        """Each sequence alone: its keys and mask, one ``ops.sparse_attention`` (the batch-invariant path). With
        ``ctx.queries`` (context parallelism) ``q``, ``iq``, ``iw`` are those rows' only; ``kv`` is every row's."""
        out = torch.empty_like(q)
        for i, (chunk, (a, b)) in enumerate(zip(ctx.chunks, ctx.offsets)):
            keys, mask = self._window(kv[a:b], chunk, ctx.positions[a:b])
            li, rel = slice(a, b), slice(None)  # the chunk's queries: in q, and in the chunk
            if ctx.queries is not None:
                li = torch.nonzero((ctx.queries >= a) & (ctx.queries < b)).flatten()
                rel = ctx.queries[li] - a
                li, rel = li.to(q.device), rel.to(q.device)
                mask = mask[rel]
            if self.ratio:
                rows = self._owner_rows(ctx, i, chunk, "rows")
                if self.indexer is not None:
                    visible = (ctx.positions[a:b][rel] + 1) // self.ratio
                    ikeys = self._owner_rows(ctx, i, chunk, "index")
                    ctx.selection[i], ctx.candidates[i] = self.indexer.select(
                        iq[li], iw[li], ikeys, visible, ctx.candidates.get(i), ops
                    )
                sel = ctx.selection.get(i)
                if sel is None or sel.shape != (mask.shape[0], rows.shape[0]):
                    raise ValueError(f"layer {self.layer_id} reuses a selection no index source made for this step")
                keys, mask = torch.cat([keys, rows.to(keys.dtype)]), torch.cat([mask, sel], dim=1)
            out[li] = ops.sparse_attention(q[li], keys, mask, self.attn_sink, self.head_dim**-0.5)
        return out

    def publish(self, x: torch.Tensor, ctx: StepContext, rope: RotaryTable, ops: Ops) -> None:
        """A KV source's compressed rows and index keys for tokens that run no attention here (the prompt rows a
        bounded decoder replay skips): ``x [T, hidden]`` are their attention inputs, ``ctx`` their chunks."""
        if self.compressor is None:
            return
        if ctx.cache is None:
            raise ValueError(f"layer {self.layer_id} is compressed and needs a PagedKVCache")
        self._publish(self.compressor.project(x, ops), ctx, rope, ops, x.dtype)

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
        ctx: StepContext,
        rope: RotaryTable,
        ops: Ops,
        dtype: torch.dtype,
    ) -> None:
        """Compress every chunk's tokens (``proj``: the batch's compressor projections); write the completed rows and
        index keys of all chunks to the paged cache in one batch."""
        key, m = (self.layer_id, "main"), self.ratio
        if proj[1] is None:  # ratio 1: a row per token, from the first one not in the cache already
            lat_all = self.compressor.norm(proj[0], ops)
            done = []
            for chunk, (a, b) in zip(ctx.chunks, ctx.offsets):
                first = max(chunk.start, chunk.state.replay_until)
                done.append((lat_all[a + min(first - chunk.start, b - a) : b], first))
        else:  # ratio 2: every sequence's completed pairs pooled in one batch
            spans = [(a, b, c.start, c.state.replay_until // m) for c, (a, b) in zip(ctx.chunks, ctx.offsets)]
            done, bufs = self.compressor.latents_many(
                proj[0], proj[1], spans, [c.state.buffers.get(key) for c in ctx.chunks], ops, dtype
            )
            for chunk, buf in zip(ctx.chunks, bufs):
                _keep_buffer(chunk.state, key, buf, chunk.end, proj[0])
        lats, pos, tables, firsts = [], [], [], []
        for chunk, (lat, first) in zip(ctx.chunks, done):
            if lat.shape[0]:
                lats.append(lat)
                pos.append(torch.arange(first, first + lat.shape[0]) * m)
                tables.append(chunk.block_table)
                firsts.append(first)
        for memo in (ctx.rows, ctx.index_keys, ctx.pools):
            for k in [k for k in memo if k[0] == self.layer_id]:
                del memo[k]
        if not lats:
            return
        lat = torch.cat(lats) if len(lats) > 1 else lats[0]
        cos, sin = rope(to_device(torch.cat(pos), lat.device), ops)
        rows = ops.rope(lat, cos, sin)
        ik = ops.rope(self.indexer.keys(lat, ops, rowwise=m > 1), cos, sin)
        if self.quant_sim:
            rows, ik = ops.cache_round(rows, "nvfp4"), ops.cache_round(ik, "mxfp4")
        sizes = [t.shape[0] for t in lats]
        for kind, data in (("rows", rows), ("index", ik)):
            parts = data.split(sizes)
            ctx.cache.write_many(kind, self.layer_id, [(t, f, r) for t, f, r in zip(tables, firsts, parts)])

    def _owner_rows(self, ctx: StepContext, i: int, chunk: SeqChunk, kind: str) -> torch.Tensor:
        """Every row of the owner (this layer's KV source) up to the chunk's end, read once per step."""
        owner = self.spec.kv_source
        memo = ctx.rows if kind == "rows" else ctx.index_keys
        got = memo.get((owner, i))
        if got is None:
            got = memo[(owner, i)] = ctx.cache.read(kind, owner, chunk.block_table, chunk.end // self.ratio)
        return got


def _keep_buffer(
    state: SequenceState, key: tuple[int, str], buf: CompressorBuffer | None, end: int, like: torch.Tensor
) -> None:
    """A ratio-2 compressor's pending rows after a step (``buf``; None: none pending at ``end``). A buffer living in
    the pool's ring (``state_pool.RingBuffer``, the decode step's) takes them in place, so the state stays pooled."""
    cur = state.buffers.get(key)
    if cur is not None and hasattr(cur, "assign"):
        cur.assign(buf if buf is not None else CompressorBuffer(like[:0], like[:0], end))
    elif buf is None:
        state.buffers.pop(key, None)
    else:
        state.buffers[key] = buf
