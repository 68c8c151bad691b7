"""The reference FP8 linears and quantisation round trips: the official FP8 activations, the FP4 simulation and the
KV cache formats, in plain torch (``deepinfer.quant``)."""

from __future__ import annotations

import torch

from deepinfer.quant.cache import fp8_window_round, mxfp4_round, nvfp4_round
from deepinfer.quant.formats import FP8_MAX, dequantize_fp8_blocks, fp4_round, pow2_scale

# the KV cache formats of ReferenceQuantOps.cache_round
_CACHE_ROUNDS = {"fp8": fp8_window_round, "nvfp4": nvfp4_round, "mxfp4": mxfp4_round}


class ReferenceQuantOps:
    """``fp8_linear``, ``fp8_grouped_linear``, ``act_quant_sim``, ``fp4_quant_sim`` and ``cache_round`` of
    :class:`ReferenceOps <deepinfer.backends.reference.ops.ReferenceOps>` (a mixin: it calls the op set's ``linear``
    and ``grouped_linear``); FP8 weights are dequantised per call."""

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
        if act_quant:
            x = self.act_quant_sim(x, 128)
        return self.linear(x, dequantize_fp8_blocks(w, scale, dtype=x.dtype))

    def fp8_grouped_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        wd = dequantize_fp8_blocks(w, scale, dtype=x.dtype)
        return self.grouped_linear(x, wd.view(x.shape[1], -1, x.shape[-1]))

    def act_quant_sim(self, x: torch.Tensor, block: int) -> torch.Tensor:
        xb = x.float().unflatten(-1, (-1, block))
        s = pow2_scale(xb.abs().amax(-1, keepdim=True), FP8_MAX, 1e-4)
        q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        return q.flatten(-2).to(x.dtype)

    def fp4_quant_sim(self, x: torch.Tensor, block: int) -> torch.Tensor:
        xb = x.float().unflatten(-1, (-1, block))
        s = pow2_scale(xb.abs().amax(-1, keepdim=True), 6.0, 6 * 2.0**-126)
        return (fp4_round(xb / s) * s).flatten(-2).to(x.dtype)

    def cache_round(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        if fmt not in _CACHE_ROUNDS:
            raise ValueError(f"cache_round: format must be one of {sorted(_CACHE_ROUNDS)}, got {fmt!r}")
        return _CACHE_ROUNDS[fmt](x)
