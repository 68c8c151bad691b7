"""DeepSeekMoE of V4 (docs/deepseek_v4.md ("Mixture of experts (MoE) and routing")): sqrt-softplus router, hash or score
routing, shared expert."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.layers import Linear
from deepinfer.ops import Ops
from deepinfer.parallel import expert_parallel


class Gate(nn.Module):
    """Router. Hash layers pick experts from the fixed ``tid2eid[token]`` table; score layers pick the
    top-k of ``score + bias`` (the bias only selects). Weights are the unbiased scores, renormalised
    and multiplied by ``routed_scaling_factor``."""

    def __init__(self, config: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        e, self.topk = config.n_routed_experts, config.num_experts_per_tok
        self.hashed, self.scaling = hashed, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size), requires_grad=False)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(e), requires_grad=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        logits = ops.linear_fp32(x, self.weight)
        if self.hashed:
            if token_ids is None:
                raise ValueError("hash-routed MoE layers need the input token ids")
            return ops.route(logits, None, self.topk, self.scaling, self.tid2eid[token_ids].long())
        return ops.route(logits, self.bias, self.topk, self.scaling)


class MoE(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate = Gate(config, hashed=layer_id < config.num_hash_layers)
        # routed experts stacked: [E, I, D] (w1 gate, w3 up) and [E, D, I] (w2 down)
        self.w1 = nn.Parameter(torch.empty(e, i, d), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, d, i), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(e, i, d), requires_grad=False)
        for name in ("w1_scale", "w2_scale", "w3_scale"):  # MXFP4 exponents when kept packed (quant.native)
            self.register_buffer(name, None)
        self.shared_w1 = Linear(d, i * config.n_shared_experts, fp8=True)
        self.shared_w2 = Linear(i * config.n_shared_experts, d, fp8=True)
        self.shared_w3 = Linear(d, i * config.n_shared_experts, fp8=True)
        self.quant_sim = False

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        idx, w = self.gate(x, token_ids, ops)

        def routed() -> torch.Tensor:
            return expert_parallel.routed(self, x, idx, w, self.limit, ops, act_quant=self.quant_sim)  # official FP8

        def shared() -> torch.Tensor:
            h = ops.swiglu(self.shared_w1(x, ops), self.shared_w3(x, ops), self.limit, x.dtype)
            return self.shared_w2(h, ops)

        y, s = ops.parallel(routed, shared, x.device)  # the shared expert may run beside the routed ones
        return ops.moe_combine(y, s, x.dtype)  # (y + shared.float()).to(x.dtype)
