"""DeepSeek's block-scaled FP8 GEMM on the vendor library: ``torch._scaled_mm`` with 1×128 activation scales and
128×128 weight scales (cuBLAS / CUTLASS on SM90, torch ≥ 2.9).

``block_scaled_mm(q, sa, w, sw, dtype)`` is ``(q · sa) @ (w · sw)ᵀ`` with fp32 accumulation: ``q [M, K]`` e4m3
activations with power-of-two scales ``sa [M, K/128]`` (``fp8_gemm.act_quant_fp8``), ``w [N, K]`` e4m3 with block
scales ``sw [N/128, K/128]``. It is what ``fp8_linear(..., act_quant=True)`` computes on its W8A8 path; on an H200,
with the activation quantisation included, it was 1.03–1.51× faster than that Triton kernel at 1024 rows and
1.24–1.57× at 4096 on V4-Flash's dense shapes, and slower below (``bench/kernels/gemm_fp8.py``, ``scaled_mm_block``
against
``fp8_linear_aq``; bench/results/engine/2026-11-30-decode-syncs.md).

The scale tensors' expected memory layouts have changed between torch builds, so the first call on a device tries
each candidate on a small problem against the dequantised product and keeps the first that matches; a device (or
build) where none runs returns None and the caller keeps its own kernel. The probe never runs while a CUDA graph is
being captured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Layout = Callable[[torch.Tensor], torch.Tensor]


def _col(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()  # the same values, outer dimension fastest ("column-major")


def _row(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


# (activation scales, weight scales ``sw.t()`` [K/128, N/128]) layouts to try, in order
CANDIDATES: tuple[tuple[Layout, Layout], ...] = ((_col, _col), (_row, _row), (_col, _row), (_row, _col))
_chosen: dict[int, tuple[Layout, Layout] | None] = {}


def _run(q, sa, w, sw, dtype, layout: tuple[Layout, Layout]) -> torch.Tensor:
    fa, fb = layout
    return torch._scaled_mm(q, w.t(), scale_a=fa(sa), scale_b=fb(sw.t()), out_dtype=dtype)


def _probe(device: torch.device) -> tuple[Layout, Layout] | None:
    g = torch.Generator(device=device).manual_seed(0)
    m, n, k = 128, 256, 512
    q = (torch.randn(m, k, generator=g, device=device) * 8).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g, device=device) * 8).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-4, 4, (m, k // 128), generator=g, device=device).float())
    sw = torch.exp2(torch.randint(-4, 4, (n // 128, k // 128), generator=g, device=device).float())
    xa = q.float() * sa.repeat_interleave(128, 1)
    wd = w.float() * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)
    ref = xa @ wd.t()
    for layout in CANDIDATES:
        try:
            out = _run(q, sa, w, sw, torch.bfloat16, layout).float()
        except (RuntimeError, TypeError, ValueError):  # this build / GPU does not take it
            continue
        if ((out - ref).norm() / ref.norm()).item() < 1e-2:  # bf16 output; a wrong layout is off by O(1)
            return layout
    return None


def available(device: torch.device) -> bool:
    """Whether ``block_scaled_mm`` runs on ``device`` (probed once per device; False while capturing a graph)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _chosen:
        if torch.cuda.is_current_stream_capturing():
            return False
        _chosen[idx] = _probe(torch.device("cuda", idx))
    return _chosen[idx] is not None


def block_scaled_mm(
    q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """``(q·sa) @ (w·sw)ᵀ`` in ``dtype`` (module docstring), or None where ``_scaled_mm`` cannot do it (block scales
    give bf16 results only)."""
    if dtype != torch.bfloat16 or q.shape[1] % 128 or w.shape[0] % 128 or not available(q.device):
        return None
    idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _run(q, sa, w, sw, dtype, _chosen[idx])


__all__ = ["available", "block_scaled_mm"]
