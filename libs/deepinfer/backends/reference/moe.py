"""The reference mixture of experts: routing, the clamped SwiGLU, the experts (dequantised, or MXFP4 decoded per
call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.quant.native import dequantize_experts
from deepinfer.quant.nibble_order import check_order, plain


class ReferenceMoEOps:
    """``route``, ``swiglu``, ``moe`` and ``moe_mxfp4`` of :class:`ReferenceOps
    <deepinfer.backends.reference.ops.ReferenceOps>` (a mixin: it calls the op set's ``linear``, ``pointwise``,
    ``topk_indices`` and ``act_quant_sim``): fp32 routing and accumulation, a Python loop over the experts used."""

    def moe(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        limit: float,
        act_quant: bool = False,
    ) -> torch.Tensor:
        if act_quant and x.shape[-1] % 128 == 0:
            x = self.act_quant_sim(x, 128)
        fp8_hidden = act_quant and w2.shape[-1] % 128 == 0
        y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            xe = x[rows]
            h = swiglu(self.linear(xe, w1[e]).float(), self.linear(xe, w3[e]).float(), limit, self)
            h = (weights[rows, slot].unsqueeze(-1).float() * h).to(x.dtype)
            if fp8_hidden:
                h = self.act_quant_sim(h, 128)
            y[rows] += self.linear(h, w2[e]).float()  # a token picks an expert at most once
        return y

    def route(
        self, logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.pointwise(F.softplus, logits).sqrt()
        if idx is None:
            idx = self.topk_indices(scores + bias.float() if bias is not None else scores, k)
        w = scores.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True) * scaling

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
        return swiglu(gate.float(), up.float(), limit, self).to(dtype)

    def moe_mxfp4(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        s1: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        w3: torch.Tensor,
        s3: torch.Tensor,
        limit: float,
        order: str = "plain",
        act_quant: bool = False,
        refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decodes only the experts ``idx`` touches, then ``moe`` (``act_quant``: with ``x`` and the hidden rows
        rounded as ``act_quant_sim(·, 128)``, the official FP8 activations, where the width is a multiple of
        128)."""
        check_order(order)
        used, local = torch.unique(idx, return_inverse=True)
        deq = [dequantize_experts(plain(w[used], order), s[used], x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3))]
        return self.moe(x, local.view(idx.shape), weights, *deq, limit, act_quant=act_quant)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, ops: ReferenceMoEOps | None = None) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, ±limit)`` (the V4 SwiGLU clamp; ``ops``: the op set whose ``pointwise``
    runs the silu)."""
    g = gate.clamp(max=limit)
    return (ops.pointwise(F.silu, g) if ops is not None else F.silu(g)) * up.clamp(-limit, limit)
