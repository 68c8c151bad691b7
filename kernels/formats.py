"""The number formats the kernels compute in, one definition each (``deepinfer.quant``, the checkpoint formats'
encode and decode, imports them from here; nothing here imports the engine).

- FP8: ``float8_e4m3fn`` values (at most ``FP8_MAX`` in magnitude) with power-of-two ``float8_e8m0fnu`` (UE8M0)
  scales, a scale per block of the weight (``dequantize_fp8_blocks``: the kernels' plain-torch path and reference) or
  per 1×128 block of an activation row (``kernels.fp8_quant``); ``pow2_scale`` is the scale rule.
- MXFP4: e2m1 codes with a UE8M0 scale per ``MXFP4_BLOCK`` codes of a row; the codes of each 32-bit word are stored
  in one of the nibble ``ORDERS`` the decodes of ``kernels.moe_mxfp4_gemm`` take (``deepinfer.quant.nibble_order``
  rearranges the words and describes each order).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
MXFP4_BLOCK = 32
ORDERS = ("plain", "shift", "rotate")  # the nibble orders of MXFP4 words (deepinfer.quant.nibble_order)


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"MXFP4 nibble order must be one of {ORDERS}, got {order!r}")


def pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """UE8M0 scale: the smallest power of two ``s`` with ``amax / s <= qmax`` (``2^ceil(log2(amax/qmax))``,
    computed exactly from the float's exponent, so no libm rounding can move it)."""
    x = amax.float().clamp_min(floor) / qmax
    mant, exp = torch.frexp(x)  # x = mant · 2^exp, mant in [0.5, 1)
    exp = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two is its own ceiling
    return torch.ldexp(torch.ones_like(x), exp)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 scale of every element of a 2-D ``shape`` from its block scales (``block`` rows × columns a scale)."""
    s = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def dequantize_fp8_blocks(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Decode an e4m3 weight with its block scales; the block size is inferred from the shapes."""
    out, inp = q.shape
    if block is None:
        # block sizes are powers of two (128 for V4, 32 for V4.1); with nb >= 2 blocks along a dim of size n
        # the block B satisfies n/nb <= B < 2n/nb, so it is the smallest power of two >= ceil(n/nb)
        # (plain ceil(n/nb) is wrong when n is not a multiple of B, e.g. 200 rows in 2 blocks of 128)
        block = (_pow2_at_least(-(-out // scale.shape[0])), _pow2_at_least(-(-inp // scale.shape[1])))
    expected = (-(-out // block[0]), -(-inp // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}")
    return (q.float() * expand_blocks(scale, q.shape, block)).to(dtype)


__all__ = ["FP8_MAX", "MXFP4_BLOCK", "ORDERS", "check_order", "dequantize_fp8_blocks", "expand_blocks", "pow2_scale"]
