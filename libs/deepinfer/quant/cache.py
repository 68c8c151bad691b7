"""The cache representations of DeepSeek-V4.1, as quantize-dequantize round trips (docs/deepseek_v41.md, "Cache
formats").

Applied after RoPE, over every channel (RoPE channels included), exactly as the released reference rounds them:

| tensor | format | scale per block |
|---|---|---|
| window KV (every layer) | FP8 E4M3, blocks of 32 | power of two ``2^ceil(log2(max(amax, 1e-4) · (1/448)))`` |
| compressed KV (KV sources) | NVFP4 E2M1, blocks of 16 | E4M3 ``fp8(max(amax, 6·2⁻⁹) / 6)``, no second-level scale |
| index keys and queries | MXFP4 E2M1, blocks of 32 | power of two ``2^ceil(log2(max(amax, 6·2⁻¹²⁶) · (1/6)))`` |

The power-of-two ceiling is taken from the float's bits (no logarithm), after multiplying by the rounded
reciprocal as the reference does (``x · (1/448)`` and ``x / 448`` differ in the last ulp, which can move a
ceiling). E2M1 rounds to nearest with ties to the even code. A trailing partial block is zero-padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.quant.formats import fp4_round

FP8_WINDOW_BLOCK = 32
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= x`` for positive normal fp32 ``x`` (exponent bits plus one if any mantissa
    bit is set)."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 255
    up = ((bits & ((1 << 23) - 1)) != 0).to(torch.int32)
    return ((exponent + up) << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    return F.pad(x.float(), (0, -n % block)).unflatten(-1, (-1, block))


def _unblocks(q: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return q.flatten(-2)[..., : like.shape[-1]].to(like.dtype)


def fp8_window_round(x: torch.Tensor, block: int = FP8_WINDOW_BLOCK) -> torch.Tensor:
    """Window-KV round trip: FP8 E4M3 with a power-of-two scale per ``block`` channels."""
    g = _blocks(x, block)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1 / 448))
    return _unblocks((g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale, x)


def nvfp4_round(x: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """Compressed-KV round trip: E2M1 with an E4M3 scale per ``block`` channels (no tensor-level scale). The scale
    saturates at 448 (blocks past ``6 · 448``): torch's own cast to E4M3 gives NaN there in some versions (2.11)
    and saturates in others (2.13)."""
    g = _blocks(x, block)
    scale = (g.abs().amax(-1, keepdim=True).clamp_min(6 * 2**-9) / 6).clamp(max=448).to(torch.float8_e4m3fn).float()
    return _unblocks(fp4_round((g / scale).clamp(-6, 6)) * scale, x)


def mxfp4_round(x: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """Index key / query round trip: E2M1 with a power-of-two (UE8M0) scale per ``block`` channels."""
    g = _blocks(x, block)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(6 * 2**-126) * (1 / 6))
    return _unblocks(fp4_round((g / scale).clamp(-6, 6)) * scale, x)
