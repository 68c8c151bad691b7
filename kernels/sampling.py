"""The sampler (``engine.sampler.Sampler``) in two Triton kernels: greedy, temperature, top-k, top-p, min-p and the
draw for a whole step, with no sort of the vocabulary, no host synchronisation and no generator objects (CUDA-graph
capturable).

``sample(logits, raw, params) -> (token_ids [B] long, logprobs [B] float32)``. ``logits [B, V]`` fp32 are the logits
choices are made on (a grammar's refused tokens already ``-inf``); ``raw`` (the same tensor, or the unconstrained
logits) gives the reported logprob of the chosen token under ``log_softmax(raw)``. ``params [B, 6]`` int64, from
``pack_params``: temperature, top-k, top-p, min-p (fp32 bit patterns for the floats), the row's 63-bit noise seed.

Semantics (``Sampler``'s, module docstring of ``engine.sampler``): ``temperature == 0`` picks the first maximum.
Otherwise, with ``s = (x - max x) · (1 / temperature)`` and tokens ranked by logit (higher first, ties to the lower
id), the kept set is the longest prefix of the ranking that satisfies all of:

* top-k: its first ``k`` tokens;
* top-p: a token is kept while the mass ranked before it, ``Σ exp(s)`` over the top-k tokens before it, is
  ``< (top_p - 1e-6) · Z_k`` (``Z_k``: the mass of the top-k tokens); the first token always;
* min-p: ``exp(s) >= min_p``.

The token is the winner of a Gumbel race over the kept set, ``argmax x_v · (1 / temperature) + G_v`` (ties to the
lower id): a draw from ``softmax(s)`` renormalised over the kept set, as the torch sampler's exponential race
``argmax p_v / q_v``.

Noise. ``G_v = -log(-log(u_v))``, ``u_v = (r_v >> 8 + 1/2) · 2^-24`` in ``(0, 1)``, where ``r_v`` is output
``(v mod 4096) // 1024`` of Philox-4x32-10 keyed by the row's seed at counter ``(v // 4096) · 1024 + v mod 1024``
(``tl.randint4x``). The noise of a token depends only on (seed, token id), never on how the work is split: a seeded
row gives the same token for the same logits in any batch, at any position in it. The worker keys a seeded request's
rows by ``(seed, position)`` (``engine.worker.position_seed``) and draws fresh seeds from torch's CPU generator for
the others.

How:

1. ``_partials_kernel``, ``parts`` programs a row (about two waves of the GPU; whole noise blocks each): per part,
   the first maximum, the raw logits' maximum and ``Σ exp``, the race's leader over every token and, for top-k, the
   per-lane maxima. Per-lane leaders and sums, one reduction at the end.
2. ``finish_kernel`` (``sampling_finish``), one program a row: merges the parts (``log Σ exp(raw)``, the first
   maximum, the leader ``w``). Without filters ``w`` is the token. Otherwise a prefix of the ranking that holds the
   kept set (from the k-th largest lane maximum, the min-p bound, or the tokens ranked before a rejected leader) is
   compacted into a short list, sorted, and the race run over its kept tokens; when no short list exists, rejection
   rounds: if the kept set holds ``w`` it is the token, else the kept set ends before ``w`` and the race is run again
   among the tokens ranked before ``w`` (one pass with noise). A race restricted to a prefix that holds the kept set
   has the same winner inside it, so both return the winner over the kept set exactly; the rounds end because the
   first-ranked token is always kept.

Differences from the torch sampler: the noise (another generator), and ranking by the logit where the torch sampler
ranks by ``s`` (equal only up to rounding ties); the top-p and min-p boundaries are computed in another summation
order (a token within ~1e-6 of a boundary may fall on the other side). Runs in Triton's interpreter (the tests).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.sampling_finish import finish_kernel
from deepinfer.kernels.sampling_lanes import first_max, gumbel, race_lanes, row_params, stats_lanes
from deepinfer.kernels.sampling_rules import TOP_P_EPS
from deepinfer.kernels.topk import pow2

NOISE_BLOCK = 4096  # part of the noise layout (module docstring): fixed, never tuned
_QUARTER = NOISE_BLOCK // 4
_NUM_WARPS = 16  # the finishing program (one a row): enough loads in flight for a lone row
_MAX_PARTS = 64
_SEED_MASK = (1 << 63) - 1
LIST = 2048  # the finishing program's short list (sampling_finish): longer lists take the rejection rounds
_SMS: dict[int | None, int] = {}


@triton.jit
def _partials_kernel(x_ptr, raw_ptr, par_ptr, pf_ptr, pi_ptr, lanes_ptr, count_ptr, V, CH, stride_x, stride_raw,
                     SEPARATE_RAW: tl.constexpr, QW: tl.constexpr, NB: tl.constexpr, NQ: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
    """Program (row, part) over columns ``[part·CH, (part+1)·CH)`` (``CH`` a multiple of ``NB``): the first maximum,
    the raw logits' maximum and ``Σ exp``, (temperature > 0) the first round's race leader over every token, and
    (top-k) the per-lane maxima."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    nparts = tl.num_programs(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    raw_row = raw_ptr + row.to(tl.int64) * stride_raw
    temp, k, top_p, min_p, seed = row_params(par_ptr, row)
    lo = part * CH
    hi = tl.minimum(lo + CH, V)
    qa = tl.arange(0, QW)
    lm = tl.full([QW], float("-inf"), tl.float32)
    li = tl.full([QW], V, tl.int32)
    rm = tl.full([QW], float("-inf"), tl.float32)
    rz = tl.zeros([QW], tl.float32)
    lg = tl.full([QW], float("-inf"), tl.float32)
    gi = tl.full([QW], V, tl.int32)
    if temp > 0:
        inv_t = 1.0 / temp
        for start in range(lo, hi, NB):  # noise block `start`: quarter j draws output j at counter start / 4 + c
            for c0 in range(0, tl.minimum(NQ, hi - start), QW):
                r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + c0 + qa)
                at = start + c0 + qa
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at, V, lm, li, rm, rz, SEPARATE_RAW)
                lg, gi = race_lanes(x, at, V, inv_t, gumbel(r0), 0, 0, 0, 0, lg, gi, False)
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at + NQ, V, lm, li, rm, rz, SEPARATE_RAW)
                lg, gi = race_lanes(x, at + NQ, V, inv_t, gumbel(r1), 0, 0, 0, 0, lg, gi, False)
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at + 2 * NQ, V, lm, li, rm, rz, SEPARATE_RAW)
                lg, gi = race_lanes(x, at + 2 * NQ, V, inv_t, gumbel(r2), 0, 0, 0, 0, lg, gi, False)
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at + 3 * NQ, V, lm, li, rm, rz, SEPARATE_RAW)
                lg, gi = race_lanes(x, at + 3 * NQ, V, inv_t, gumbel(r3), 0, 0, 0, 0, lg, gi, False)
    else:  # greedy: the same walk without the noise (four loads in flight a lane)
        for start in range(lo, hi, NB):
            for c0 in range(0, tl.minimum(NQ, hi - start), QW):
                at = start + c0 + qa
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at, V, lm, li, rm, rz, SEPARATE_RAW)
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at + NQ, V, lm, li, rm, rz, SEPARATE_RAW)
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at + 2 * NQ, V, lm, li, rm, rz, SEPARATE_RAW)
                x, lm, li, rm, rz = stats_lanes(x_row, raw_row, at + 3 * NQ, V, lm, li, rm, rz, SEPARATE_RAW)
    m, a = first_max(lm, li, V)
    rmax = tl.max(rm, 0)
    rsum = tl.sum(rz * tl.exp(rm - tl.where(rmax == float("-inf"), 0.0, rmax)), 0)
    best, bid = first_max(lg, gi, V)
    out = row * nparts + part
    tl.store(pf_ptr + out * 4, m)
    tl.store(pf_ptr + out * 4 + 1, rmax)
    tl.store(pf_ptr + out * 4 + 2, rsum)
    tl.store(pf_ptr + out * 4 + 3, best)
    tl.store(pi_ptr + out * 2, a)
    tl.store(pi_ptr + out * 2 + 1, bid)
    if k < V:
        tl.store(lanes_ptr + out.to(tl.int64) * QW + qa, lm)
    if part == 0:
        tl.store(count_ptr + row, 0)  # the finishing program's list counter


@triton.jit
def _noise_kernel(seed_ptr, out_ptr, V, QW: tl.constexpr, NB: tl.constexpr, NQ: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    qa = tl.arange(0, QW)
    out_row = out_ptr + row.to(tl.int64) * V
    for start in range(0, V, NB):
        for c0 in range(0, tl.minimum(NQ, V - start), QW):
            r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + c0 + qa)
            at = start + c0 + qa
            tl.store(out_row + at, gumbel(r0), mask=at < V)
            tl.store(out_row + at + NQ, gumbel(r1), mask=at + NQ < V)
            tl.store(out_row + at + 2 * NQ, gumbel(r2), mask=at + 2 * NQ < V)
            tl.store(out_row + at + 3 * NQ, gumbel(r3), mask=at + 3 * NQ < V)


def _widths(vocab: int, cuda: bool) -> tuple[int, int, int]:
    """(scan width, race width = lanes, short list): the full sizes on a GPU; in Triton's interpreter (host tensors)
    256 lanes and a list of 64 (kept small: its loops and ranks run in Python)."""
    p = max(16, pow2(vocab))
    if cuda:
        return min(NOISE_BLOCK, p), min(_QUARTER, p), min(LIST, p)
    return min(NOISE_BLOCK, p), min(256, p), min(64, p)


def noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Gumbel noise ``G [len(seeds), vocab]`` the kernel draws for these seeds (int64, ``< 2^63``)."""
    out = torch.empty((seeds.numel(), vocab), dtype=torch.float32, device=seeds.device)
    if seeds.numel():
        qw = _widths(vocab, seeds.is_cuda)[1]
        _noise_kernel[(seeds.numel(),)](seeds.contiguous(), out, vocab, QW=qw, NB=NOISE_BLOCK, NQ=_QUARTER)
    return out


def pack_params(
    temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float], seeds: list[int], vocab: int
) -> torch.Tensor:
    """The kernels' ``[B, 6]`` int64 row parameters, on the host: top-k ``0`` / ``-1`` / ``>= V`` become ``V``
    (off); seeds are taken modulo ``2^63``."""
    out = np.zeros((len(top_k), 6), dtype=np.int64)
    out[:, [0, 2, 3]] = np.array([temperature, top_p, min_p], dtype=np.float32).view(np.int32).T
    ks = np.array(top_k, dtype=np.int64)
    out[:, 1] = np.where((ks > 0) & (ks < vocab), ks, vocab)
    out[:, 4] = np.array([s & _SEED_MASK for s in seeds], dtype=np.int64)
    return torch.from_numpy(out)


def _parts(rows: int, vocab: int, device: torch.device, invariant: bool = False) -> int:
    """Programs a row for the first pass: about two waves of the GPU, whole noise blocks each; ``invariant``: one
    noise block each whatever the batch (a row's logprob sums its parts' partials, so another split rounds it
    differently: the batch-invariant mode keeps one split for every batch)."""
    blocks = -(-vocab // NOISE_BLOCK)
    if device.type != "cuda":
        return 1
    if invariant:
        return min(blocks, _MAX_PARTS)
    sms = _SMS.get(device.index)
    if sms is None:
        sms = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks, -(-2 * sms // rows), _MAX_PARTS))


def sample(
    logits: torch.Tensor, raw: torch.Tensor, params: torch.Tensor, parts: int | None = None, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's tokens and their raw logprobs (module docstring); ``params`` from ``pack_params``, on the device.
    ``parts``: programs a row for the first pass (default: by the batch and the GPU's size, or with ``invariant``
    the same for every batch, so a row's logprob is bit-identical in any batch; 1 on the host). The tokens never
    depend on the split."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or raw.shape != logits.shape or raw.dtype != torch.float32:
        raise ValueError(f"expected fp32 logits and raw [B, V], got {logits.shape} {logits.dtype} / {raw.shape}")
    b, v = logits.shape
    if params.shape != (b, 6) or params.dtype != torch.int64:
        raise ValueError(f"expected params [{b}, 6] int64 (pack_params), got {tuple(params.shape)} {params.dtype}")
    if v >= 2**31 - NOISE_BLOCK:
        raise ValueError(f"vocabulary of {v} columns is too wide")
    tok = torch.empty(b, dtype=torch.long, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tok, lp
    block, qw, lmax = _widths(v, logits.is_cuda)
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    r = raw if raw.stride(-1) == 1 else raw.contiguous()
    blocks = -(-v // NOISE_BLOCK)
    p = min(parts or _parts(b, v, logits.device, invariant), blocks)
    ch = -(-blocks // p) * NOISE_BLOCK
    p = -(-v // ch)
    pf = torch.empty((b, p, 4), dtype=torch.float32, device=logits.device)
    pi = torch.empty((b, p, 2), dtype=torch.int32, device=logits.device)
    lanes = torch.empty((b, p, qw), dtype=torch.float32, device=logits.device)
    short = torch.empty((b, lmax), dtype=torch.int32, device=logits.device)
    count = torch.empty(b, dtype=torch.int32, device=logits.device)
    par = params.contiguous()
    sep = r.data_ptr() != x.data_ptr()
    warps = 8 if qw == _QUARTER else 4 if qw >= 128 else 1
    _partials_kernel[(b, p)](x, r, par, pf, pi, lanes, count, v, ch, x.stride(0), r.stride(0), SEPARATE_RAW=sep, QW=qw,
                             NB=NOISE_BLOCK, NQ=_QUARTER, num_warps=warps, **pdl.launch())  # fmt: skip
    finish_kernel[(b,)](x, r, par, pf, pi, lanes, short, count, tok, lp, v, p, x.stride(0), r.stride(0), BLOCK=block,
                         QW=qw, NB=NOISE_BLOCK, NQ=_QUARTER, PMAX=max(2, pow2(p)), LMAX=lmax, LSMALL=min(128, lmax),
                         EPS=TOP_P_EPS, SORT=logits.is_cuda, num_warps=_NUM_WARPS if block == NOISE_BLOCK else 4,
                         **pdl.launch())  # fmt: skip
    return tok, lp


__all__ = ["NOISE_BLOCK", "noise", "pack_params", "sample"]
