"""DeepSeekMoE of V4.1 (docs/deepseek_v41.md ("MoE: modality-aware routing")): modality-aware sqrt-softplus score
routing, no hash layers.

Differences from V4 (``deepseek_v4.moe``): every layer routes by score; the selection bias is ``bias``
(e_score_correction) for text tokens and ``bias_vl`` for image-span tokens (all four span types); the top-k
weights are renormalised with a literal ``+ 1e-20`` (only when ``norm_topk_prob`` and top-k > 1, as NeMo).
Routed and shared experts both use the clamped SwiGLU (``silu(min(g, L)) · clamp(u, ±L)``). The draft
(DSpark) MoE is the same module with its own expert count and top-k.

Top-k tie rule: ``ops.topk_indices`` (equal biased scores go to the lower expert index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v4.layers import Linear
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.ops import Ops
from deepinfer.parallel import expert_parallel

RENORM_EPS = 1e-20  # literal in the reference; not rms_norm_eps


class Gate(nn.Module):
    """Router (released ``ffn.gate.{weight,bias,bias_vl}``; NeMo ``e_score_correction_bias`` = ``bias``).

    Scores ``s = sqrt(softplus(x · Wᵀ))`` in fp32; experts = top-k of ``s + bias`` (text) or ``s + bias_vl``
    (image span); weights = the unbiased ``s`` of the chosen experts, renormalised, × ``routed_scaling_factor``."""

    def __init__(self, config: DeepseekV41TextConfig, n_experts: int, topk: int) -> None:
        super().__init__()
        self.topk, self.scaling, self.renorm = topk, config.routed_scaling_factor, config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, config.hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.bias_vl = nn.Parameter(torch.zeros(n_experts), requires_grad=False)

    def scores(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Unbiased fp32 scores ``[T, E]`` of ``x [T, D]``."""
        return ops.pointwise(F.softplus, ops.linear_fp32(x, self.weight)).sqrt()

    def selection_bias(self, image_mask: torch.Tensor | None) -> torch.Tensor:
        """``[E]`` (all text) or ``[T, E]``: ``bias_vl`` on image-span rows, ``bias`` elsewhere."""
        if image_mask is None:
            return self.bias.float()
        return torch.where(image_mask.bool().unsqueeze(-1), self.bias_vl.float(), self.bias.float())

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids ``[T, k]``, fp32 weights ``[T, k]``) for ``x [T, D]``; ``image_mask [T]`` bool or None."""
        s = self.scores(x, ops)
        idx = ops.topk_indices(s + self.selection_bias(image_mask), self.topk)
        w = s.gather(1, idx)
        if self.renorm and self.topk > 1:
            w = w / (w.sum(-1, keepdim=True) + RENORM_EPS)
        return idx, w * self.scaling


class MoE(nn.Module):
    """Routed experts (stacked ``w1/w3 [E, I, D]``, ``w2 [E, D, I]``) plus one shared expert, all clamped SwiGLU."""

    def __init__(self, config: DeepseekV41TextConfig, n_experts: int | None = None, topk: int | None = None) -> None:
        super().__init__()
        e = config.n_routed_experts if n_experts is None else n_experts
        k = config.num_experts_per_tok if topk is None else topk
        if not 0 < k <= e:
            raise ValueError(f"MoE top-k must lie in 1..{e} experts, got {k}")
        d, i = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate = Gate(config, e, k)
        self.w1 = nn.Parameter(torch.empty(e, i, d), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, d, i), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(e, i, d), requires_grad=False)
        for name in ("w1_scale", "w2_scale", "w3_scale"):  # MXFP4 exponents when kept packed (quant.native)
            self.register_buffer(name, None)
        self.shared_w1 = Linear(d, i * config.n_shared_experts, fp8=True)
        self.shared_w2 = Linear(i * config.n_shared_experts, d, fp8=True)
        self.shared_w3 = Linear(d, i * config.n_shared_experts, fp8=True)

    @classmethod
    def draft(cls, config: DeepseekV41TextConfig) -> MoE:
        """The DSpark stages' MoE (``dspark_n_routed_experts``, top ``dspark_num_experts_per_tok``)."""
        return cls(config, config.dspark_n_routed_experts, config.dspark_num_experts_per_tok)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        """``x [T, D]`` (already ``ffn_norm``-ed) → ``[T, D]`` in ``x.dtype``."""
        idx, w = self.gate(x, image_mask, ops)

        def routed() -> torch.Tensor:
            return expert_parallel.routed(self, x, idx, w, self.limit, ops)

        def shared() -> torch.Tensor:
            h = ops.swiglu(self.shared_w1(x, ops), self.shared_w3(x, ops), self.limit, x.dtype)
            return self.shared_w2(h, ops)

        y, s = ops.parallel(routed, shared, x.device)  # the shared expert may run beside the routed ones
        return (y + s.float()).to(x.dtype)
