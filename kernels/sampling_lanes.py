"""The sampler kernels' per-lane pieces (``kernels.sampling``): Gumbel noise from Philox outputs, per-lane leaders,
maxima and sums, and a row's parameters."""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels.topk import order_value


@triton.jit
def gumbel(r):
    """Gumbel noise from uint32 Philox outputs: ``u`` in ``(0, 1)`` with 24 bits, ``-log(-log u)``."""
    u = ((r >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
    return -tl.log(-tl.log(u))


@triton.jit
def stats_lanes(x_row, raw_row, offs, V, lm, li, rm, rz, SEPARATE_RAW: tl.constexpr):
    """Per lane: the first maximum of the logits, the running maximum and ``Σ exp`` of the raw logits."""
    msk = offs < V
    x = tl.load(x_row + offs, mask=msk, other=float("-inf"))
    take = (x > lm) | ((x == lm) & (offs < li))
    if SEPARATE_RAW:
        r = tl.load(raw_row + offs, mask=msk, other=float("-inf"))
    else:
        r = x
    nm = tl.maximum(rm, r)
    base = tl.where(nm == float("-inf"), 0.0, nm)
    return x, tl.where(take, x, lm), tl.where(take, offs, li), nm, rz * tl.exp(rm - base) + tl.exp(r - base)


@triton.jit
def race_lanes(x, offs, V, inv_t, noise, t_v, cut, bound_v, bound_id, lg, gi, RESTRICT: tl.constexpr):
    """Per lane: the race's leader (score ``x / T + G``, ties to the lower id); with ``RESTRICT`` among the top-k
    tokens ranked before the bound only."""
    cand = offs < V
    if RESTRICT:
        v = order_value(x)
        topk = (v > t_v) | ((v == t_v) & (offs <= cut))
        cand = cand & topk & ((v > bound_v) | ((v == bound_v) & (offs < bound_id)))
    g = tl.where(cand, x * inv_t + noise, float("-inf"))
    take = (g > lg) | ((g == lg) & (offs < gi))
    return tl.where(take, g, lg), tl.where(take, offs, gi)


@triton.jit
def first_max(vals, ids, V):
    """The maximum of per-lane leaders and its lowest id."""
    best = tl.max(vals, 0)
    return best, tl.min(tl.where(vals == best, ids, V), 0)


@triton.jit
def row_params(par_ptr, row):
    par = par_ptr + row * 6
    temp = tl.load(par).to(tl.int32).to(tl.float32, bitcast=True)
    k = tl.load(par + 1).to(tl.int32)
    top_p = tl.load(par + 2).to(tl.int32).to(tl.float32, bitcast=True)
    min_p = tl.load(par + 3).to(tl.int32).to(tl.float32, bitcast=True)
    return temp, k, top_p, min_p, tl.load(par + 4)


@triton.jit
def noise_at(seed, ids, NB: tl.constexpr, NQ: tl.constexpr):
    """The noise of tokens ``ids`` in the layout of the module docstring of ``kernels.sampling`` (four Philox
    outputs a token, the right one kept)."""
    r0, r1, r2, r3 = tl.randint4x(seed, (ids // NB) * NQ + ids % NQ)
    j = (ids % NB) // NQ
    return gumbel(tl.where(j == 0, r0, tl.where(j == 1, r1, tl.where(j == 2, r2, r3))))
