"""DeepSeek-V4 (V4-Flash, V4-Pro and their -Base) in plain PyTorch over the ops interface.

``forward`` runs one step of several sequences (each a chunk of new tokens, prefill or decode) and
returns the final hidden streams; ``logits`` applies the head to the rows asked for; ``mtp`` runs
the MTP block. Nothing here knows about scheduling, transport or kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deepinfer.models.deepseek_v4 import verify_split, verify_step
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.context_split import split_forward
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable, embedding
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool, use_pool
from deepinfer.ops import Ops, get_ops
from deepinfer.parallel.context_parallel import ContextParallel, splits
from deepinfer.runtime.host_copy import tensor

if TYPE_CHECKING:
    from deepinfer.runtime.step_graphs import StepGraphs


def _hc_params(module: nn.Module, prefix: str, n: int, dim: int, outputs: int) -> None:
    module.register_parameter(f"{prefix}_fn", nn.Parameter(torch.zeros(outputs, n * dim), requires_grad=False))
    module.register_parameter(f"{prefix}_base", nn.Parameter(torch.zeros(outputs), requires_grad=False))
    scales = 3 if outputs > n else 1
    module.register_parameter(f"{prefix}_scale", nn.Parameter(torch.ones(scales), requires_grad=False))


class Block(nn.Module):
    """One layer: mHC collapse → attention → mHC expand, then the same around the MoE."""

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        self.config, self.layer_id = config, layer_id
        n, dim = config.hc_mult, config.hidden_size
        self.attn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.attn = Attention(config, layer_id)
        self.ffn = MoE(config, layer_id)
        _hc_params(self, "hc_attn", n, dim, (2 + n) * n)
        _hc_params(self, "hc_ffn", n, dim, (2 + n) * n)

    def _hc(self, h: torch.Tensor, name: str, ops: Ops) -> tuple[torch.Tensor, ...]:
        c = self.config
        return ops.hc_pre(
            h,
            getattr(self, f"{name}_fn"),
            getattr(self, f"{name}_scale"),
            getattr(self, f"{name}_base"),
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
        )

    def attn_in(
        self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, ops: Ops
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """mHC collapse, norm and the attention's projections (``Attention.project``), with the mHC ``post`` and
        ``comb`` that ``ffn_out`` needs. Touches no state."""
        x, post, comb = self._hc(h, "hc_attn", ops)
        return self.attn.project(self.attn_norm(x, ops), positions, rope, ops), post, comb

    def ffn_out(
        self,
        out: torch.Tensor,
        t: dict[str, torch.Tensor],
        h: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        token_ids: torch.Tensor | None,
        ops: Ops,
    ) -> torch.Tensor:
        """The attention output (``Attention.output``) expanded into the streams, then the MoE sublayer. Touches no
        state."""
        h = ops.hc_expand(self.attn.output(out, t, ops), h, post, comb)
        x, post, comb = self._hc(h, "hc_ffn", ops)
        x = self.ffn(self.ffn_norm(x, ops), token_ids, ops)
        return ops.hc_expand(x, h, post, comb)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        offsets: list[tuple[int, int]],
        cache: PagedKVCache | None,
        rope: RotaryTable,
        ops: Ops,
        token_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        t, post, comb = self.attn_in(h, batch.positions, rope, ops)
        out = self.attn.attend(t, batch.chunks, offsets, batch.positions, cache, rope, ops)
        return self.ffn_out(out, t, h, post, comb, token_ids, ops)


class MTPBlock(Block):
    """The multi-token-prediction block (``mtp.k``): a SWA block fed by the trunk's streams at t and
    the embedding of token t+1; predicts token t+2 through the shared head."""

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        dim = config.hidden_size
        self.e_proj = Linear(dim, dim, fp8=True)
        self.h_proj = Linear(dim, dim, fp8=True)
        self.enorm = RMSNorm(dim, config.rms_norm_eps)
        self.hnorm = RMSNorm(dim, config.rms_norm_eps)
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        _hc_params(self, "hc_head", config.hc_mult, dim, config.hc_mult)


class DeepseekV4Model(nn.Module):
    verify_on_decode_path = True  # speculative verify steps may run as decode sub-steps (verify_step.py)
    # their attention in one call over every sub-step's rows (verify_attention.py), else in turns: one call is 2-16%
    # faster a verify step on the H200 (bench/results/engine/2026-12-05-speculative-verify-*.md)
    verify_fused = True

    def verify_forward(self, batch: ForwardBatch, cache: PagedKVCache | None, verified: list[int], pad: int = 0
                       ) -> tuple[torch.Tensor, None, verify_step.PooledVerify] | None:  # fmt: skip
        """A speculative verify step on the decode path (``verify_step.pooled_forward``: the hidden streams, no
        drafter features, the rollback), or None where that path does not take ``batch`` (``verify_step.eligible``:
        the caller runs the ragged path, ``speculative``). A step whose prompt chunks the path cannot hold runs them
        as a plain step beside it (``verify_split``)."""
        if verify_step.eligible(self, batch.chunks):
            h, pending = verify_step.pooled_forward(self, batch, cache, verified, pad)
            return h, None, pending
        mixed = verify_split.split(self, batch, verified)
        if mixed is None or not verify_step.eligible(self, mixed.verify.chunks):
            return None
        rest = self(mixed.rest, cache)
        self.split_steps += 1
        h, pending = verify_step.pooled_forward(self, mixed.verify, cache, mixed.verified, pad)
        return mixed.merge(h, rest), None, mixed.adopt(pending)

    def __init__(self, config: DeepseekV4Config, ops: Ops | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or get_ops("cpu")
        c = config
        for i in c.mtp_layer_ids:
            if c.ratio(i) != 0:
                raise ValueError(f"MTP layer {i} has compress ratio {c.ratio(i)}; only sliding-window MTP is supported")
        self.embed = embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Block(c, i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, c.vocab_size)
        _hc_params(self, "hc_head", c.hc_mult, c.hidden_size, c.hc_mult)
        self.mtp = nn.ModuleList([MTPBlock(c, i) for i in c.mtp_layer_ids])
        self.rope_main = RotaryTable(c.qk_rope_head_dim, c.rope_theta, None)
        self.rope_compress = RotaryTable(c.qk_rope_head_dim, c.compress_rope_theta, c.yarn)
        # the runtime's choice of graphs for a step (runtime.step_graphs.StepGraphs, attached by the family's build or
        # family.step_graphs(); None: every step eager); it makes and keeps the graphs here on the first step that may
        # use them (graphs.DecodeGraphs, prefill_graphs.PrefillGraphs)
        self.step_graphs: StepGraphs | None = None
        self.verifying = False  # a speculative verify step: the attention layers keep their projections
        self.decode_graphs: Any = None
        self.prefill_graphs: Any = None
        self.verify_graphs: Any = None  # verify steps on the decode path (verify_graphs.VerifyGraphs)
        self.draft_graphs: Any = None  # the MTP drafter's loop and observe pass (draft_graphs)
        self.observe_graphs: Any = None
        self.pooled_decode = True  # decode steps keep windows and compressor buffers in a StatePool (state_pool.py)
        self.state_pool: StatePool | None = None
        self._pool_given: StatePool | None = None  # the pool the attention layers hold
        self.cp: ContextParallel | None = None  # this rank's context-parallel group (``parallel.context_parallel``)
        self.split_steps = 0  # verify steps run as two forwards (``verify_split``; a rank group counts forwards)

    def set_quant_sim(self, enabled: bool) -> None:
        """Simulate the official quantisation points (FP8 activations/KV, FP4 indexer)."""
        for m in self.modules():
            if hasattr(m, "quant_sim"):
                m.quant_sim = enabled

    def rope_of(self, layer_id: int) -> RotaryTable:
        """The rotary table of a layer (compressed layers use the compress flavour)."""
        return self.rope_compress if self.config.ratio(layer_id) else self.rope_main

    def embed_streams(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The ``hc_mult`` input streams ``[T, hc_mult, D]`` of ``token_ids``."""
        return self.embed(token_ids.unsqueeze(1).expand(-1, self.config.hc_mult))  # one gather, no broadcast copy

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache | None) -> torch.Tensor:
        """Run the trunk on ``batch``; returns the final hidden streams ``[T, hc_mult, D]``. With ``step_graphs``
        attached the step may replay CUDA graphs, as the runtime decides (``runtime.step_graphs``: a decode step
        ``graphs.DecodeGraphs``, other steps piecewise ``prefill_graphs.PrefillGraphs``), with eager results."""
        ops = self.ops
        self._use_pool(not ops.invariant_by_sequence and self.pooled_decode)
        if self.state_pool is not None:
            self.state_pool.begin_step()
        graphs = self.step_graphs
        h = None if graphs is None else graphs.run(self, batch, cache, self.verifying)  # None: run eagerly
        if h is None and splits(self, batch):  # context parallelism: this rank's tokens, every token's state
            h = split_forward(self, batch, cache, self.cp)
        if h is None:
            offsets = batch.offsets()
            h = self.embed_streams(batch.token_ids)
            for layer in self.layers:
                h = layer(h, batch, offsets, cache, self.rope_of(layer.layer_id), ops, batch.token_ids)
        for c in batch.chunks:
            c.state.num_tokens = c.end
        if self.state_pool is not None:
            self.state_pool.end_step()
        return h

    def _use_pool(self, on: bool) -> None:
        """Give every attention layer the model's ``StatePool`` (made on the weights' device), or none."""
        use_pool(self, on, Attention)

    def _head(self, h: torch.Tensor, owner: nn.Module, norm: RMSNorm) -> torch.Tensor:
        c, ops = self.config, self.ops
        x, _, _ = ops.hc_pre(h, owner.hc_head_fn, owner.hc_head_scale, owner.hc_head_base, 0, c.hc_eps, c.rms_norm_eps)
        y = norm(x, ops)
        return ops.logits_linear(y, self.head.weight)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[T', vocab]`` of hidden streams ``[T', hc_mult, D]``."""
        return self._head(h, self, self.norm)

    @torch.no_grad()
    def mtp_forward(
        self, h: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP block ``depth`` on trunk streams ``h`` (positions of ``batch``) and the ids of the tokens
        that follow them; returns (its streams, fp32 logits ``[chunks, vocab]`` of each chunk's last row: the token
        after its last id; a drafter needs no other row's, and a prefill chunk's every row would take
        ``rows x vocab x 4`` bytes).

        The block keeps its own window in each sequence's state (layer id ``num_hidden_layers+depth``)."""
        ops, blk = self.ops, self.mtp[depth]
        if self.state_pool is not None:
            self.state_pool.begin_step()
        e = blk.enorm(self.embed(next_ids), ops)
        x = blk.e_proj(e, ops).unsqueeze(1) + blk.h_proj(blk.hnorm(h, ops), ops)
        chunks = [SeqChunk(c.state, c.state.mtp_tokens, c.length, c.block_table) for c in batch.chunks]
        pos = torch.cat([torch.arange(c.start, c.end) for c in chunks]).to(next_ids.device)
        mbatch = ForwardBatch(next_ids, pos, chunks)
        x = blk(x, mbatch, mbatch.offsets(), None, self.rope_main, ops, next_ids)
        for c in chunks:
            c.state.mtp_tokens = c.end
        if self.state_pool is not None:
            self.state_pool.end_step()
        if x.shape[0] == len(chunks):  # a row per chunk (a drafting step): every row is a last one
            return x, self._head(x, blk, blk.norm)
        last = tensor([b - 1 for _, b in mbatch.offsets()], x.device, torch.long)  # (no wait for the device)
        return x, self._head(x.index_select(0, last), blk, blk.norm)
