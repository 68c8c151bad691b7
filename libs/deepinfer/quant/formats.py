"""The official weight formats (docs/deepseek_v4.md, "Checkpoint format"), encode and decode.

- FP8: ``float8_e4m3fn`` weight ``[out, in]`` with ``float8_e8m0fnu`` block scales
  ``[ceil(out/B0), ceil(in/B1)]`` (B = 128×128 for V4, 32×32 for V4.1); ``W = w8 · scale``.
- MXFP4 (routed experts): ``int8`` ``[out, in/2]``, element ``2k`` in the low nibble and ``2k+1`` in
  the high nibble of byte ``k``, e2m1 codes; ``float8_e8m0fnu`` scales ``[out, in/32]``.

Scales are powers of two rounded *up* (UE8M0), so every decoded value is exact in fp32 and bf16
can hold it whenever the product fits bf16's 8-bit mantissa (always true for e4m3 × 2^k).
"""

from __future__ import annotations

import torch

# the formats the kernels compute in are defined once, with the kernels (deepinfer.kernels.formats)
from deepinfer.kernels.formats import FP8_MAX, MXFP4_BLOCK, dequantize_fp8_blocks, expand_blocks, pow2_scale

FP4_MAX = 6.0
# e2m1 code -> value; bit 3 is the sign
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight to e4m3 with per-block UE8M0 scales (what the official converter stores)."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    out, inp = w.shape
    nb0, nb1 = -(-out // block[0]), -(-inp // block[1])
    wf = w.float()
    padded = torch.zeros(nb0 * block[0], nb1 * block[1], device=w.device)
    padded[:out, :inp] = wf.abs()
    amax = padded.view(nb0, block[0], nb1, block[1]).amax(dim=(1, 3))
    scale = pow2_scale(amax, FP8_MAX, 1e-30)
    q = (wf / expand_blocks(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``[out, in]`` to packed e2m1 (int8 ``[out, in/2]``) with per-32 UE8M0 scales."""
    out, inp = w.shape
    if inp % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs in_features divisible by {MXFP4_BLOCK}, got {inp}")
    wb = w.float().view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = pow2_scale(wb.abs().amax(-1), FP4_MAX, 6 * 2.0**-126)
    codes = fp4_codes(wb / scale.unsqueeze(-1)).view(out, inp)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out, half = packed.shape
    inp = half * 2
    if tuple(scale.shape) != (out, inp // MXFP4_BLOCK):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}")
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(out, inp)
    vals = _fp4_values(packed.device)[codes].view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK) * scale.float().unsqueeze(-1)
    return vals.view(out, inp).to(dtype)


_FP4_ON: dict[torch.device, torch.Tensor] = {}
_FP4_EDGES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# the magnitudes between consecutive e2m1 values, with where each tie goes: to the even code (0, 1, 2, 4, 6 are
# the even codes' values), so ties at 0.25, 1.25, 2.5 and 5 round down and those at 0.75, 1.75 and 3.5 round up
_FP4_MIDPOINTS = ((0.25, "down"), (0.75, "up"), (1.25, "down"), (1.75, "up"), (2.5, "down"), (3.5, "up"), (5.0, "down"))


def _fp4_values(device: torch.device) -> torch.Tensor:
    """``FP4_VALUES`` on ``device``, made once per device (no copy per call, so the rounding can run inside a CUDA
    graph)."""
    got = _FP4_ON.get(device)
    if got is None:
        got = _FP4_ON[device] = FP4_VALUES.to(device)
    return got


def _fp4_edges(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``bucketize`` boundaries (``right=True``) of the e2m1 magnitudes in ``dtype``, made once per device and dtype:
    a tie that rounds down sits below its boundary (the midpoint's next representable value up), one that rounds up
    on it."""
    got = _FP4_EDGES.get((device, dtype))
    if got is None:
        mid = torch.tensor([m for m, _ in _FP4_MIDPOINTS], dtype=dtype)
        down = torch.tensor([d == "down" for _, d in _FP4_MIDPOINTS])
        edges = torch.where(down, torch.nextafter(mid, torch.full_like(mid, float("inf"))), mid)
        got = _FP4_EDGES[(device, dtype)] = edges.to(device)
    return got


def fp4_codes(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even mantissa), saturating at ±6; returns codes (bit 3 the sign,
    from the sign bit: ``-0.0`` and the negative values that round to zero keep it)."""
    idx = torch.bucketize(v.abs(), _fp4_edges(v.device, v.dtype), right=True)
    return idx | (torch.signbit(v).long() << 3)


def fp4_round(v: torch.Tensor) -> torch.Tensor:
    """Values rounded onto the e2m1 grid (for the quantisation simulation)."""
    return _fp4_values(v.device)[fp4_codes(v)]


__all__ = [
    "FP4_MAX",
    "FP4_VALUES",
    "FP8_MAX",
    "MXFP4_BLOCK",
    "dequantize_fp8_blocks",
    "dequantize_mxfp4",
    "expand_blocks",
    "fp4_codes",
    "fp4_round",
    "pow2_scale",
    "quantize_fp8_blocks",
    "quantize_mxfp4",
]
