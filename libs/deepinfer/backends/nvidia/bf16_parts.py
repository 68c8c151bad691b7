"""An fp32 × bf16 matrix product on bf16 tensor cores, exact in its products: DeepSeek-V4.1's output head.

V4.1's reference applies the head in fp32 to the final norm's fp32 output (docs/deepseek_v41.md, "Single-pass (lagged)
mHC"). The released checkpoint stores the head in bf16 and the loader widens it to fp32
(``checkpoint.names_v41.keeps_fp32``): an fp32 GEMM then reads 2.1 GB a step at V4.1-Flash's vocabulary (618 µs at one
row on an H200, 1.7 ms at 64 rows on fp32 units; ``bench/engine/sweep_v41.py --profile``). Two exact steps give the same
products on bf16 tensor cores:

* ``narrow_lossless``: the widened weight holds bf16 values, so it is kept in bf16 (half the bytes) when every
  element survives the round trip (checked, never assumed).
* ``bf16_parts``: an fp32 ``y`` is the sum ``hi + mid + lo`` of three bf16 tensors (8 significant bits each, 24 in
  all; bf16 has fp32's exponent range; exact but at the tiny and huge ends, see ``bf16_parts``), so ``y · W = hi · W
  + mid · W + lo · W`` where each product of bf16 values is exact in fp32. ``linear_by_parts`` stacks the three
  parts as rows of one GEMM with fp32 accumulation (the weight read once) and adds the three fp32 results. It equals
  the reference's fp32 GEMM up to the order of the fp32 sums, as the bf16 head of V4 does
  (``NvidiaOps.logits_linear``).
"""

from __future__ import annotations

import torch

ROWS = 256  # rows of ``y`` per GEMM: bounds the [3·ROWS, N] fp32 temporary (prompt logprobs may ask many rows)


def bf16_parts(y: torch.Tensor) -> torch.Tensor:
    """``[3, *y.shape]`` bf16 whose sum in fp32 is ``y`` (largest part first): exactly where ``2^-110 <= |y| <
    2^128 - 2^120`` or ``y = 0`` (the last part's bits then stay above bf16's smallest subnormal, and ``hi`` does not
    round to infinity); below ``2^-110`` within ``2^-133``."""
    hi = y.to(torch.bfloat16)
    rest = y - hi.float()  # exact: the low 16 bits of y's significand
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)  # exact: at most 8 bits remain
    return torch.stack([hi, mid, lo])


def linear_by_parts(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``y [..., K]`` times bf16 ``w [N, K]``ᵀ: fp32 ``[..., N]`` (module docstring). Needs ``torch.mm`` with
    ``out_dtype`` (raises TypeError / RuntimeError without it)."""
    x = y.reshape(-1, y.shape[-1])
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=y.device)
    for a in range(0, x.shape[0], ROWS):
        part = x[a : a + ROWS]
        n = part.shape[0]
        prods = torch.mm(bf16_parts(part).view(3 * n, -1), w.t(), out_dtype=torch.float32).view(3, n, -1)
        torch.add(prods[0], prods[1], out=out[a : a + n]).add_(prods[2])
    return out.view(*y.shape[:-1], -1)


@torch.no_grad()
def narrow_lossless(p: torch.nn.Parameter, rows: int = 4096) -> bool:
    """Keep the fp32 parameter ``p`` in bf16 if every element is a bf16 value (checked ``rows`` rows at a time);
    returns whether it did."""
    if p.dtype != torch.float32:
        return False
    flat = p.data.view(p.shape[0], -1) if p.dim() else p.data.view(1, 1)
    for a in range(0, flat.shape[0], rows):
        chunk = flat[a : a + rows]
        if not torch.equal(chunk.to(torch.bfloat16).float(), chunk):
            return False
    p.data = p.data.to(torch.bfloat16)
    return True


__all__ = ["ROWS", "bf16_parts", "linear_by_parts", "narrow_lossless"]
