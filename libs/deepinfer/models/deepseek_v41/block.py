"""One layer of the DeepSeek-V4.1 text backbone (docs/deepseek_v41.md): the Engram memory (``Engram`` and its
table, layers in ``engram_layer_ids``), then the lagged mHC around CSA2 attention and the modality-aware MoE
(``Block``). ``Block.attn_in`` and ``Block.ffn_out`` split the layer at the state, for the graphed steps.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable
from deepinfer.models.deepseek_v41.attention import Attention
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.engram import engram_update
from deepinfer.models.deepseek_v41.layout import LayerSpec
from deepinfer.models.deepseek_v41.mhc import HyperConnection, Mix
from deepinfer.models.deepseek_v41.mhc import lagged_sublayer as _lagged
from deepinfer.models.deepseek_v41.moe import MoE
from deepinfer.models.deepseek_v41.step_context import StepContext
from deepinfer.ops import Ops
from deepinfer.runtime.host_copy import to_device


class EngramTable(nn.Module):
    """One Engram memory table (``layers.{i}.engram.embed.weight [rows, head_dim]``) behind a lookup op, so the
    table can live apart from the model (in host memory: ``DeepseekV41Model.place_engram_tables``): ``lookup``
    gathers on the table's device and moves only the rows read."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim), requires_grad=False)

    def lookup(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Table rows ``[..., n, dim]`` for row ids ``rows [..., n]``, on ``device``."""
        return to_device(self.weight[rows.to(self.weight.device)], device)


class Engram(nn.Module):
    """``layers.{i}.engram``: hashed n-gram memory gated into every stream (docs/deepseek_v41.md ("Engram"))."""

    def __init__(self, config: DeepseekV41TextConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.slot = tuple(c.engram_layer_ids).index(layer_id)
        self.eps = c.rms_norm_eps
        self.embed = EngramTable(c.engram_num_embeddings[self.slot], c.engram_head_dim)
        self.wkv = Linear(
            c.num_engram_hashes * c.engram_head_dim, (c.hc_mult + 1) * c.hidden_size, fp8=True, keeps_fp8=False
        )
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size), requires_grad=False)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, token_mask: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        return self.update(h, self.embed.lookup(rows, h.device), token_mask, ops)

    def update(self, h: torch.Tensor, e: torch.Tensor, token_mask: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        """The streams ``h`` updated with looked-up table rows ``e [T, hashes, head_dim]``."""
        return engram_update(h, e, self.wkv.weight, self.q_weight, self.k_weight, self.eps, token_mask, ops)


class Block(nn.Module):
    """``layers.{i}``: (Engram) → lagged mHC around attention → lagged mHC around the MoE."""

    def __init__(self, config: DeepseekV41TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)
        self.attn = Attention(config, spec)
        self.ffn = MoE(config)
        self.engram = Engram(config, spec.index) if spec.engram else None

    def forward(
        self,
        h: torch.Tensor,
        pre: torch.Tensor,
        ctx: StepContext,
        rope: RotaryTable,
        ops: Ops,
        engram_rows: torch.Tensor | None,
        text_mask: torch.Tensor | None,
        image_mask: torch.Tensor | None,
        capture: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams ``h [T, N, D]`` and the previous sublayer's ``pre`` → new streams and this block's FFN ``pre``.
        ``capture`` receives the (post-Engram) streams entering the attention mHC: a DSpark target feature."""
        if self.engram is not None:
            h = self.engram(h, engram_rows, text_mask, ops)
        if capture is not None:
            capture.append(h)
        mix, t = self.attn_in(h, pre, ctx.positions, rope, ops)
        return self.ffn_out(self.attn.attend(t, ctx, rope, ops), t, h, mix, image_mask, ops)

    def attn_in(
        self, h: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor, rope: RotaryTable, ops: Ops
    ) -> tuple[Mix, dict[str, torch.Tensor]]:
        """The attention sublayer up to the state (lagged mHC, ``mhc.lagged_sublayer``): the mixes of the
        (post-Engram) streams ``h``, and ``Attention.project`` of ``attn_norm(collapse(h, pre))``. Touches no state."""
        mix = self.hc_attn(h, ops)
        return mix, self.attn.project(self.attn_norm(ops.hc_collapse(h, pre), ops), positions, rope, ops)

    def ffn_out(
        self,
        out: torch.Tensor,
        t: dict[str, torch.Tensor],
        h: torch.Tensor,
        mix: Mix,
        image_mask: torch.Tensor | None,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output ``out [T, H, d]`` projected (``Attention.output``) and expanded into the streams
        ``h`` with ``mix``, then the lagged FFN sublayer; returns the new streams and the FFN ``pre``. Touches no
        state."""
        h = ops.hc_expand(self.attn.output(out, t["cos"], t["sin"], ops), h, mix.post, mix.comb)
        return _lagged(h, mix.pre, self.hc_ffn, lambda x: self.ffn(self.ffn_norm(x, ops), image_mask, ops), ops)
