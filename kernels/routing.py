"""The MoE router's epilogue and the shared expert's SwiGLU as single Triton kernels (decode sizes: each replaces a
chain of small torch kernels that a CUDA graph replays one after another).

* ``route(logits, bias, k, scaling, idx=None)``: V4's ``Gate`` after its fp32 GEMM (docs/deepseek_v4.md, "The router"):
  ``s = sqrt(softplus(logits))``; the experts ``idx`` are the top ``k`` of ``s + bias`` in the order of a stable
  descending sort (ties to the lower expert; ``kernels.topk``'s keys), or given (hash layers); the weights are
  ``s[idx] / Σ s[idx] · scaling``. One program per token: the row's scores, ``k`` rounds of a maximum over unique
  keys, the sum in pick order. ``softplus`` is torch's (``x`` above 20, else ``log1p(exp(x))``, the same CUDA math
  functions), the square root and the division correctly rounded: the scores and the choice are the reference's;
  the weights differ from it at most by the order of the ``k``-term sum.
* ``swiglu(gate, up, limit, dtype)``: ``silu(min(gate, limit)) · clamp(up, ±limit)`` in fp32, rounded to ``dtype``
  (the shared expert's hidden state), one pass over ``gate`` and ``up`` in their dtype; torch's ``silu`` formula
  ``x / (1 + exp(-x))`` with the same ``expf``: within an ulp of torch's fp32 result (an H200 run differed from
  the CPU's torch by an ulp in fp32, not at all after rounding to bf16).

Without CUDA (or in Triton's interpreter, the CPU tests) the same kernels run on host tensors; no host sync, no
data-dependent shape: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm_config import interpreted
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.topk import SMALL_K, SMALL_WIDTH, order_value

_NEG = tl.constexpr(-9223372036854775807)
SWIGLU_BLOCK = 1024


def _cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and not interpreted()


@triton.jit
def _exp(x, CUDA: tl.constexpr):
    """``expf`` (libdevice: torch's CUDA kernels call the same function) on CUDA; numpy's in the interpreter."""
    return libdevice.exp(x) if CUDA else tl.exp(x)


@triton.jit
def _softplus_sqrt(x, CUDA: tl.constexpr):
    e = _exp(x, CUDA)
    return tl.sqrt_rn(tl.where(x > 20.0, x, libdevice.log1p(e) if CUDA else tl.log(1.0 + e)))


@triton.jit
def _route_kernel(l_ptr, b_ptr, idx_ptr, w_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                  GIVEN: tl.constexpr, BIAS: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = c < E
    s = _softplus_sqrt(tl.load(l_ptr + row * E + c, mask=live, other=0.0), CUDA)
    if not GIVEN:
        sel = s + tl.load(b_ptr + c, mask=live, other=0.0) if BIAS else s
        key = tl.where(live, (order_value(sel).to(tl.int64) << 32) + (4294967295 - c.to(tl.int64)), _NEG)
    kk = tl.arange(0, KP)
    picks = tl.zeros((KP,), dtype=tl.int64)
    vals = tl.zeros((KP,), dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(K):
        if GIVEN:
            e = tl.load(idx_ptr + row * K + j)
        else:
            top = tl.max(key, 0)
            e = 4294967295 - (top & 4294967295)
            key = tl.where(key == top, _NEG, key)
        v = tl.sum(tl.where(c == e, s, 0.0), 0)  # one term and zeros: exact
        picks = tl.where(kk == j, e, picks)
        vals = tl.where(kk == j, v, vals)
        total += v  # in pick order
    w = tl.div_rn(vals, tl.zeros((KP,), dtype=tl.float32) + total) * scaling
    if not GIVEN:
        tl.store(idx_ptr + row * K + kk, picks, mask=kk < K)
    tl.store(w_ptr + row * K + kk, w, mask=kk < K)


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float, idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx [T, k] long, weights [T, k] fp32)`` of the router logits ``[T, E]`` fp32 (module docstring); ``idx``
    given: those experts (hash layers), only the weights computed. ``E <= 4096``, ``k <= 32``."""
    t, e = logits.shape
    if e > SMALL_WIDTH or not 0 < k <= min(e, SMALL_K):
        raise ValueError(f"route: needs at most {SMALL_WIDTH} experts and 0 < k <= {SMALL_K}, got E={e}, k={k}")
    if idx is not None and tuple(idx.shape) != (t, k):
        raise ValueError(f"route: idx must be [{t}, {k}], got {tuple(idx.shape)}")
    logits = logits.float().contiguous()
    out_idx = (
        idx.long().contiguous() if idx is not None else torch.empty((t, k), dtype=torch.long, device=logits.device)
    )
    w = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    if t:
        b = bias.float().contiguous() if bias is not None else logits
        block = max(16, triton.next_power_of_2(e))
        _route_kernel[(t,)](
            logits, b, out_idx, w, e, float(scaling), K=k, KP=triton.next_power_of_2(k), BLOCK=block,
            GIVEN=idx is not None, BIAS=bias is not None, CUDA=_cuda(logits), num_warps=4 if block > 1024 else 1,
            **pdl.launch(),
        )  # fmt: skip
    return out_idx, w


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, limit, BLOCK: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.minimum(tl.load(g_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(u_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    h = tl.div_rn(g, 1.0 + _exp(-g, CUDA)) * u  # torch's silu: x / (1 + exp(-x)), correctly rounded
    tl.store(out_ptr + row * N + offs, h.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, ±limit)`` in fp32, rounded to ``dtype``: ``gate, up [..., N]``."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n).contiguous(), up.reshape(-1, n).contiguous()
    out = torch.empty(g.shape, dtype=dtype, device=gate.device)
    if g.numel():
        block = min(SWIGLU_BLOCK, triton.next_power_of_2(n))
        _swiglu_kernel[(g.shape[0], triton.cdiv(n, block))](
            g, u, out, n, float(limit), BLOCK=block, CUDA=_cuda(g), num_warps=4, **pdl.launch()
        )
    return out.view(gate.shape)


__all__ = ["route", "swiglu"]
