"""DSpark, the parallel block drafter of DeepSeek-V4.1 (docs/deepseek_v41.md ("DSpark")), released as ``mtp.0..K-1``.

Each stage is a V4.1 block (lagged mHC, draft MoE ``MoE.draft``) with SWA-only attention: main RoPE
(θ = ``rope_theta``, no YaRN), no compressor or indexer, per-head sink, FP8 window KV (``quant_sim``). Stage 0 also owns
``main_proj [D, L·D]`` + ``main_norm``; the last stage owns ``norm``, the Markov head and the confidence head
(``dspark_heads``). The embedding and the LM head are the target's, passed in.

Drafting one block per sequence, anchored at position ``p`` (the anchor = the last verified token):

- target features: the residual streams entering ``dspark_target_layer_ids`` (post-Engram, the ``attn_hc`` input),
  mean over the ``hc_mult`` streams, concatenated → ``[L·D]`` per position; ``main_x = main_norm(main_proj(·))``.
- context KV of stage k for position j: ``fp8(rope(kv_norm(wkv_k(main_x_j)), j))`` (no ``attn_norm``: main_x goes
  straight into ``wkv``), for the window ``[p-W, p-1]`` (W = ``sliding_window``; rows before 0 do not exist).
  An engine caches these rows per stage; ``context_kv`` computes them, ``gather_window`` cuts windows from them.
- queries: the ``B = dspark_block_size`` block inputs ``[anchor, noise×(B-1)]`` at positions ``p..p+B-1``; keys:
  the context rows plus the block's own KV rows, **non-causal** within the block; other blocks are invisible.
- output: ``h = collapse(X, last ffn pre)``, ``U = head(norm(h))`` fp32, then the Markov / confidence loop.

This module is model code only: no cache management, scheduling or transport.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable
from deepinfer.models.deepseek_v41.attention import SharedKVAttention
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.dspark_heads import (
    CONFIDENCE_INPUTS,
    ConfidenceHead,
    ConfidenceInput,
    DraftResult,
    MarkovHead,
    Sampler,
    markov_draft,
)
from deepinfer.models.deepseek_v41.mhc import (
    HyperConnection,
    embed_streams,
    final_collapse,
    initial_pre,
    lagged_sublayer,
)
from deepinfer.models.deepseek_v41.moe import MoE
from deepinfer.ops import Ops


def gather_window(rows: torch.Tensor, anchor_positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context window ``[p-W, p-1]`` of each anchor from ``rows [S, ...]`` indexed by absolute position.

    Returns ``(rows [N, W, ...], mask [N, W])``; slots before position 0 are masked (their content is row 0)."""
    if anchor_positions.ndim != 1:
        raise ValueError(f"anchor_positions must have shape [N], got {tuple(anchor_positions.shape)}")
    if anchor_positions.numel() and (int(anchor_positions.min()) < 0 or int(anchor_positions.max()) > rows.shape[0]):
        raise ValueError(
            f"anchor positions must lie in 0..{rows.shape[0]} (context rows exist for positions < {rows.shape[0]}), "
            f"got {anchor_positions.tolist()}"
        )
    j = anchor_positions.unsqueeze(1) - window + torch.arange(window, device=anchor_positions.device)
    mask = j >= 0
    if rows.shape[0] == 0:
        return rows.new_zeros(anchor_positions.shape[0], window, *rows.shape[1:]), mask
    return rows[j.clamp_min(0)], mask


def _key_lists(ctx_mask: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key lists over the pool ``[context rows (N·C) ; block rows (N·B)]``: a query of sequence ``i`` sees
    the ``B`` rows of its own block, then its visible context rows. Returns ``idx [N·B, B+C]``, ``count [N·B]``."""
    n, c = ctx_mask.shape
    dev = ctx_mask.device
    order = torch.sort((~ctx_mask).to(torch.uint8), dim=1, stable=True).indices  # visible rows first
    ctx_idx = order + (torch.arange(n, device=dev) * c).unsqueeze(1)
    blk_idx = n * c + (torch.arange(n, device=dev) * block).unsqueeze(1) + torch.arange(block, device=dev)
    idx = torch.cat([blk_idx, ctx_idx], dim=1)
    count = block + ctx_mask.sum(1)
    return idx.repeat_interleave(block, dim=0), count.repeat_interleave(block)


class DraftAttention(SharedKVAttention):
    """SWA-only shared-K=V MQA of a DSpark stage (released ``mtp.{k}.attn.*``), non-causal within the block."""

    def __init__(self, config: DeepseekV41TextConfig) -> None:
        super().__init__(config)
        self.rope = RotaryTable(config.qk_rope_head_dim, config.rope_theta, None)  # main RoPE, no YaRN

    def kv(self, x: torch.Tensor, positions: torch.Tensor, ops: Ops) -> torch.Tensor:
        """FP8-rounded rotated KV rows ``[T, head_dim]`` of ``x [T, D]`` at ``positions [T]``."""
        cos, sin = self.rope(positions, ops)
        return self.window_kv(x, cos, sin, ops)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: torch.Tensor, ctx_mask: torch.Tensor, ops: Ops
    ) -> torch.Tensor:
        """``x [N·B, D]`` (``attn_norm``-ed block inputs, block-major) at ``positions [N·B]``; ``ctx_kv [N, C, d]``
        (this stage's context rows, from ``kv``) visible where ``ctx_mask [N, C]``. Returns ``[N·B, D]``."""
        t, (n, c) = x.shape[0], ctx_mask.shape
        cos, sin = self.rope(positions, ops)
        _, q, kv = self.queries_and_kv(x, cos, sin, ops)
        keys = torch.cat([ctx_kv.reshape(n * c, self.head_dim).to(kv.dtype), kv])
        idx, count = _key_lists(ctx_mask, t // n)
        out = ops.sparse_attention_lists(q, keys, idx, count, self.attn_sink, self.head_dim**-0.5)
        return self.output(out, cos, sin, ops)


class DraftStage(nn.Module):
    """One DSpark stage ``mtp.{k}``: the backbone's per-block names (``attn_norm``, ``ffn_norm``, ``hc_attn``,
    ``hc_ffn``, ``attn``, ``ffn``) plus, on the first stage, ``main_proj``/``main_norm`` and, on the last,
    ``norm``/``markov_head``/``confidence_head`` (``None`` elsewhere)."""

    def __init__(self, config: DeepseekV41TextConfig, stage: int) -> None:
        super().__init__()
        c, dim = config, config.hidden_size
        self.stage = stage
        self.attn_norm = RMSNorm(dim, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, c.rms_norm_eps)
        self.hc_attn = HyperConnection(c)
        self.hc_ffn = HyperConnection(c)
        self.attn = DraftAttention(c)
        self.ffn = MoE.draft(c)
        self.main_proj: Linear | None = None
        self.main_norm: RMSNorm | None = None
        self.norm: RMSNorm | None = None
        self.markov_head: MarkovHead | None = None
        self.confidence_head: ConfidenceHead | None = None
        if stage == 0:
            self.main_proj = Linear(dim * len(c.dspark_target_layer_ids), dim, fp8=True)
            self.main_norm = RMSNorm(dim, c.rms_norm_eps)
        if stage == c.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(dim, c.rms_norm_eps)
            self.markov_head = MarkovHead(c.vocab_size, c.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(dim, c.dspark_markov_rank)

    def forward(
        self,
        h: torch.Tensor,
        pre: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: torch.Tensor,
        ctx_mask: torch.Tensor,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams ``h [N·B, hc, D]`` and the carried ``pre [N·B, hc]`` → the new pair (lagged mHC hand-off)."""

        def attend(x: torch.Tensor) -> torch.Tensor:
            return self.attn(self.attn_norm(x, ops), positions, ctx_kv, ctx_mask, ops)

        def ffn(x: torch.Tensor) -> torch.Tensor:
            return self.ffn(self.ffn_norm(x, ops), None, ops)  # drafts are text: the gate's ``bias``

        h, pre = lagged_sublayer(h, pre, self.hc_attn, attend, ops)
        return lagged_sublayer(h, pre, self.hc_ffn, ffn, ops)


class DSparkDrafter(nn.Module):
    """The DSpark stages (``mtp``) and the drafting entry points (module docstring).

    ``confidence_input`` selects what the confidence head reads: ``"pre_norm"`` (the released reference: the
    collapsed residual h) or ``"normed"`` (NeMo AutoModel-trained drafts: ``norm(h)``)."""

    def __init__(self, config: DeepseekV41TextConfig, confidence_input: ConfidenceInput = "pre_norm") -> None:
        super().__init__()
        c = config
        if c.num_nextn_predict_layers < 1:
            raise ValueError("DSpark needs num_nextn_predict_layers >= 1 draft stages, got 0")
        if c.dspark_block_size < 1:
            raise ValueError(f"DSpark needs dspark_block_size >= 1, got {c.dspark_block_size}")
        if c.dspark_markov_rank < 1:
            raise ValueError(f"DSpark needs dspark_markov_rank >= 1, got {c.dspark_markov_rank}")
        ids = list(c.dspark_target_layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= c.num_hidden_layers:
            raise ValueError(
                f"dspark_target_layer_ids must be strictly increasing layer ids in [0, {c.num_hidden_layers}), "
                f"got {ids}"
            )
        if not 0 <= c.dspark_noise_token_id < c.vocab_size:
            raise ValueError(f"dspark_noise_token_id {c.dspark_noise_token_id} lies outside vocab_size={c.vocab_size}")
        if confidence_input not in CONFIDENCE_INPUTS:
            raise ValueError(f"confidence_input must be one of {CONFIDENCE_INPUTS}, got {confidence_input!r}")
        self.config = c
        self.confidence_input: ConfidenceInput = confidence_input
        self.block_size, self.window, self.noise_id = c.dspark_block_size, c.sliding_window, c.dspark_noise_token_id
        self.mtp = nn.ModuleList(DraftStage(c, k) for k in range(c.num_nextn_predict_layers))

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features: ``len(dspark_target_layer_ids) · hidden_size``."""
        return len(self.config.dspark_target_layer_ids) * self.config.hidden_size

    def target_features(self, captured: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate the stream means of the residual streams ``[..., hc, D]`` captured at the inputs of
        ``dspark_target_layer_ids`` (in that order) → ``[..., L·D]``."""
        c = self.config
        want = len(c.dspark_target_layer_ids)
        if len(captured) != want:
            raise ValueError(
                f"expected {want} captured stream tensors (layers {c.dspark_target_layer_ids}), got {len(captured)}"
            )
        shape = captured[0].shape
        for i, s in enumerate(captured):
            if s.ndim < 2 or s.shape[-2:] != (c.hc_mult, c.hidden_size) or s.shape != shape:
                raise ValueError(
                    f"captured streams must all have shape [..., hc_mult={c.hc_mult}, hidden={c.hidden_size}], "
                    f"entry {i} has {tuple(s.shape)} (entry 0: {tuple(shape)})"
                )
        return torch.cat([s.mean(dim=-2) for s in captured], dim=-1)

    def project(self, features: torch.Tensor, ops: Ops) -> torch.Tensor:
        """``main_x = main_norm(main_proj(features))``: ``[..., L·D]`` → ``[..., D]`` (stage 0's weights)."""
        if features.shape[-1] != self.feature_dim:
            raise ValueError(
                f"DSpark target features must have width {len(self.config.dspark_target_layer_ids)} x "
                f"{self.config.hidden_size} = {self.feature_dim}, got {tuple(features.shape)}"
            )
        first = self.mtp[0]
        return first.main_norm(first.main_proj(features, ops), ops)

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor, ops: Ops) -> list[torch.Tensor]:
        """Every stage's FP8 context KV rows ``[T, head_dim]`` of ``main_x [T, D]`` at ``positions [T]``."""
        if main_x.ndim != 2 or main_x.shape[1] != self.config.hidden_size or positions.shape != main_x.shape[:1]:
            raise ValueError(
                f"context_kv takes main_x [T, {self.config.hidden_size}] and positions [T], "
                f"got {tuple(main_x.shape)} and {tuple(positions.shape)}"
            )
        return [stage.attn.kv(main_x, positions, ops) for stage in self.mtp]

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """Block input ids ``[N, B]``: each anchor followed by ``B-1`` noise tokens."""
        noise = torch.full(
            (anchors.shape[0], self.block_size - 1), self.noise_id, dtype=anchors.dtype, device=anchors.device
        )  # (made there: no host copy, so a CUDA graph can hold it)
        return torch.cat([anchors.unsqueeze(1), noise], dim=1)

    def hidden(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: Sequence[torch.Tensor],
        ctx_mask: torch.Tensor,
        embed_weight: torch.Tensor,
        ops: Ops,
    ) -> torch.Tensor:
        """The last stage's pre-norm collapsed residual ``h [N, B, D]`` for blocks ``block_ids [N, B]`` whose first
        input sits at ``positions [N]``; ``ctx_kv[k] [N, C, head_dim]`` is stage k's context (``ctx_mask [N, C]``)."""
        c = self.config
        if block_ids.ndim != 2 or block_ids.shape[1] != self.block_size:
            raise ValueError(
                f"DSpark blocks must have shape [N, dspark_block_size={self.block_size}], got {tuple(block_ids.shape)}"
            )
        n, b = block_ids.shape
        if positions.shape != (n,):
            raise ValueError(
                f"positions must have shape [{n}] (one anchor position per block), got {tuple(positions.shape)}"
            )
        if ctx_mask.ndim != 2 or ctx_mask.shape[0] != n or ctx_mask.dtype != torch.bool:
            raise ValueError(f"ctx_mask must be a bool [{n}, C] tensor, got {ctx_mask.dtype} {tuple(ctx_mask.shape)}")
        if len(ctx_kv) != len(self.mtp):
            raise ValueError(f"ctx_kv needs one tensor per DSpark stage ({len(self.mtp)}), got {len(ctx_kv)}")
        want = (n, ctx_mask.shape[1], c.head_dim)
        for k, kv in enumerate(ctx_kv):
            if tuple(kv.shape) != want:
                raise ValueError(f"ctx_kv[{k}] must have shape {list(want)}, got {tuple(kv.shape)}")
        if n == 0:
            return embed_weight.new_zeros(0, b, c.hidden_size)
        pos = (positions.unsqueeze(1) + torch.arange(b, device=positions.device)).flatten()
        h = embed_streams(F.embedding(block_ids.flatten(), embed_weight), c.hc_mult)
        pre = initial_pre(n * b, c.hc_mult, h.device)
        for stage, kv in zip(self.mtp, ctx_kv):
            h, pre = stage(h, pre, pos, kv, ctx_mask, ops)
        return final_collapse(h, pre, ops).view(n, b, -1)

    def draft(
        self,
        anchors: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: Sequence[torch.Tensor],
        ctx_mask: torch.Tensor,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        ops: Ops,
        sampler: Sampler | None = None,
    ) -> DraftResult:
        """Draft one block per sequence: ``anchors [N]`` (last verified tokens) at ``positions [N]``, context as in
        ``hidden``; ``embed_weight [V, D]`` / ``head_weight [V, D]`` are the target's. ``sampler`` picks each token
        from its Markov-corrected logits (default: greedy argmax)."""
        if anchors.ndim != 1:
            raise ValueError(f"anchors must have shape [N], got {tuple(anchors.shape)}")
        h = self.hidden(self.block_inputs(anchors), positions, ctx_kv, ctx_mask, embed_weight, ops)
        n, b, _ = h.shape
        last = self.mtp[-1]
        normed = last.norm(h, ops)
        base = ops.logits_linear(normed.flatten(0, 1), head_weight).view(n, b, head_weight.shape[0])
        conf_in = h if self.confidence_input == "pre_norm" else normed
        return markov_draft(base, h, conf_in, anchors, last.markov_head, last.confidence_head, ops, sampler)
