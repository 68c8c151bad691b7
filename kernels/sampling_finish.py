"""The sampler's second kernel (``kernels.sampling``, module docstring): one program a row merges the first pass's
parts, then finds the token among a short list of candidates, or by rejection rounds when the list would be long.

The short list. Tokens ranked by logit form a prefix ``{x >= tau}`` (or the tokens ranked before a rejected leader)
that holds the kept set; with at most ``LMAX`` of them, the program compacts their ids (one pass over the row, slots
from an atomic counter), sorts them by rank (``tl.sort`` of ``-key << 32 | id``, ``LSMALL`` entries when they fit),
and applies top-k (the first ``k``), top-p (``tl.cumsum`` of
the top-k probabilities against ``Z_k``) and min-p to the sorted list; the token is the race's winner among them,
each drawing its own noise (``noise_at``). One pass over the row; the rest stays in registers. ``tau``:

* top-k (``k <= QW``): the k-th largest of the first pass's per-lane maxima, a lower bound of the k-th logit (the
  lanes are ``QW`` disjoint sets of tokens, so at least ``k`` tokens reach it); the list holds the top-k.
* min-p (unless top-p applies to a top-k list): ``max x + T · (log min_p - 1e-3)``, below every kept token.
* top-p alone: no ``tau``; the first pass's leader is checked (one pass for ``Z`` and the mass ranked before it); when
  rejected, the list is the tokens ranked before it.

Otherwise (``k > QW``, a list longer than ``LMAX``, or a row whose every logit ties) the rejection rounds of the
module docstring run, with a radix select for the k-th logit (``tl.histogram``: slow when most keys share a digit)
and a pass with noise per round.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels.pdl import pdl_wait
from deepinfer.kernels.sampling_lanes import first_max, gumbel, noise_at, race_lanes, row_params
from deepinfer.kernels.topk import INT_MIN, order_value, pick

_I64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)


@triton.jit
def _ascending(keys, N: tl.constexpr, SORT: tl.constexpr):
    """``keys [N]`` sorted ascending: ``tl.sort`` (GPU), or each key placed at its rank by pairwise comparisons (the
    interpreter, where ``tl.sort`` runs in Python; ties keep their order)."""
    if SORT:
        out = tl.sort(keys, 0)
    else:
        i = tl.arange(0, N)
        before = (keys[None, :] < keys[:, None]) | ((keys[None, :] == keys[:, None]) & (i[None, :] < i[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)
        out = tl.sum(tl.where(rank[None, :] == i[:, None], keys[None, :], tl.zeros_like(keys)[None, :]), 1)
    return out


@triton.jit
def _kth_lane_max(lanes_row, P, k, QW: tl.constexpr, SORT: tl.constexpr):
    """The k-th largest per-lane maximum over the ``P`` parts' lanes (lane ``l`` of every part is one set)."""
    qa = tl.arange(0, QW)
    lm = tl.full([QW], float("-inf"), tl.float32)
    for p in range(0, P):
        lm = tl.maximum(lm, tl.load(lanes_row + p * QW + qa))
    ranked = _ascending(-lm, QW, SORT)
    return -tl.sum(tl.where(qa == k - 1, ranked, 0.0), 0)


@triton.jit
def _compact(x_row, list_row, count_ptr, V, tau, bound_v, bound_id, LMAX: tl.constexpr, BLOCK: tl.constexpr):
    """The ids of the finite tokens with ``x >= tau`` ranked before the bound into ``list_row`` (in no order: the
    list is sorted next; slots from an atomic counter the first pass zeroed, at most ``LMAX`` stored); returns how
    many there are."""
    ar = tl.arange(0, BLOCK)
    n = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + ar
        msk = offs < V
        x = tl.load(x_row + offs, mask=msk, other=float("-inf"))
        v = order_value(x)
        sel = msk & (x >= tau) & (x > float("-inf")) & ((v > bound_v) | ((v == bound_v) & (offs < bound_id)))
        at = tl.atomic_add(count_ptr + tl.zeros([BLOCK], tl.int32), 1, mask=sel, sem="relaxed")
        tl.store(list_row + at, offs, mask=sel & (at < LMAX))
        n = tl.maximum(n, tl.where(sel, at + 1, 0))
    return tl.max(n, 0)


@triton.jit
def _list_pick(x_row, list_row, n, m, inv_t, k, top_p, min_p, z, seed, V, NB: tl.constexpr, NQ: tl.constexpr,
               LMAX: tl.constexpr, EPS: tl.constexpr, SORT: tl.constexpr):  # fmt: skip
    """The race's winner over the kept set within the listed prefix (``n <= LMAX`` ids); ``z``: the mass top-p is
    measured against (``Z``), or a negative number for the list's own top-k mass."""
    idx = tl.arange(0, LMAX)
    valid = idx < n
    ids = tl.load(list_row + idx, mask=valid, other=0)
    x = tl.load(x_row + ids, mask=valid, other=float("-inf"))
    order = tl.where(valid, ((-order_value(x)).to(tl.int64) << 32) | ids.to(tl.int64), _I64_MAX)
    order = _ascending(order, LMAX, SORT)  # rank: logit descending, then id ascending
    ids = (order & 0xFFFFFFFF).to(tl.int32)
    x = tl.load(x_row + ids, mask=valid, other=float("-inf"))
    p = tl.where(valid, tl.exp((x - m) * inv_t), 0.0)
    pk = tl.where(idx < k, p, 0.0)
    zk = tl.where(z < 0, tl.sum(pk, 0), z)
    excl = tl.cumsum(pk, 0) - pk
    limit = tl.where(top_p >= 1.0, float("inf"), (top_p - EPS) * zk)
    keep = valid & (idx < k) & ((idx == 0) | (excl < limit)) & (p >= min_p)
    g = tl.where(keep, x * inv_t + noise_at(seed, ids, NB, NQ), float("-inf"))
    return first_max(g, tl.where(valid, ids, V), V)


@triton.jit
def _mass_before(x_row, V, m, inv_t, vw, w, BLOCK: tl.constexpr):
    """``(Z, mass ranked before w, tokens ranked before w)`` in one pass."""
    ar = tl.arange(0, BLOCK)
    acc_z = tl.zeros([BLOCK], tl.float32)
    acc_b = tl.zeros([BLOCK], tl.float32)
    cnt = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + ar
        msk = offs < V
        x = tl.load(x_row + offs, mask=msk, other=float("-inf"))
        v = order_value(x)
        e = tl.where(msk, tl.exp((x - m) * inv_t), 0.0)
        ahead = msk & ((v > vw) | ((v == vw) & (offs < w)))
        acc_z += e
        acc_b += tl.where(ahead, e, 0.0)
        cnt += ahead.to(tl.int32)
    return tl.sum(acc_z, 0), tl.sum(acc_b, 0), tl.sum(cnt, 0)


@triton.jit
def _mass(x_row, V, m, inv_t, t_v, cut, BLOCK: tl.constexpr):
    """``Σ exp(s)`` over the top-k tokens (key above ``t_v``, or equal up to id ``cut``; ``INT_MIN``: every token)."""
    ar = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + ar
        msk = offs < V
        x = tl.load(x_row + offs, mask=msk, other=float("-inf"))
        v = order_value(x)
        keep = msk & ((v > t_v) | ((v == t_v) & (offs <= cut)))
        acc += tl.where(keep, tl.exp((x - m) * inv_t), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _kth_key(x_row, V, k, BLOCK: tl.constexpr):
    """``(t_v, cut)``: the k-th logit's key (radix select, four histogram passes) and the last tied id kept."""
    ar = tl.arange(0, BLOCK)
    prefix = 0
    need = k
    ties = 0
    for d in tl.static_range(4):
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + ar
            msk = offs < V
            u = order_value(tl.load(x_row + offs, mask=msk, other=float("-inf"))) ^ INT_MIN
            above_digit = ((u ^ prefix).to(tl.uint32, bitcast=True) >> (24 - 8 * d)) >> 8  # the higher digits
            hist += tl.histogram((u >> (24 - 8 * d)) & 255, 256, mask=msk & (above_digit == 0))
        b, above = pick(hist, need)
        need -= above
        prefix = prefix | (b << (24 - 8 * d))
        ties = tl.sum(tl.where(tl.arange(0, 256) == b, hist, 0), 0)
    t_v = prefix ^ INT_MIN
    cut = V
    if ties > need:  # keep the first `need` tied tokens
        carry = 0
        for start in range(0, V, BLOCK):
            offs = start + ar
            msk = offs < V
            tie = msk & (order_value(tl.load(x_row + offs, mask=msk, other=float("-inf"))) == t_v)
            cs = tl.cumsum(tie.to(tl.int32), 0) + carry
            cut = tl.minimum(cut, tl.min(tl.where(tie & (cs == need), offs, V), 0))
            carry += tl.sum(tie.to(tl.int32), 0)
    return t_v, cut


@triton.jit
def _rounds(x_row, V, m, a, best, bid, inv_t, k, top_p, min_p, seed, BLOCK: tl.constexpr, QW: tl.constexpr,
            NB: tl.constexpr, NQ: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    """The rejection rounds (module docstring of ``kernels.sampling``) from the leader ``(best, bid)``."""
    t_v = INT_MIN
    cut = V
    if k < V:
        t_v, cut = _kth_key(x_row, V, k, BLOCK)
    zk = 1.0
    if top_p < 1.0:
        zk = _mass(x_row, V, m, inv_t, t_v, cut, BLOCK)
    lo = float("-inf")  # the races skip tokens below min-p's bound (kept tokens are all above it)
    if min_p > 0.0:
        lo = m + (tl.log(min_p) - 1e-3) * (1.0 / inv_t)
    qa = tl.arange(0, QW)
    w = a
    done = 0
    while done == 0:
        if best == float("-inf"):  # no token with a finite score: the first maximum
            w = a
            done = 1
        else:
            w = bid
            xw = tl.load(x_row + w)
            vw = order_value(xw)
            ok = ((vw > t_v) | ((vw == t_v) & (w <= cut))) & (tl.exp((xw - m) * inv_t) >= min_p)
            if ok & (top_p < 1.0):
                _z, excl, _n = _mass_before(x_row, V, m, inv_t, vw, w, BLOCK)
                ok = (excl == 0.0) | (excl < (top_p - EPS) * zk)
            if ok:
                done = 1
            else:  # the kept set ends before w: race again among the top-k tokens ranked before it
                lg = tl.full([QW], float("-inf"), tl.float32)
                gi = tl.full([QW], V, tl.int32)
                for start in range(0, V, NB):
                    for c0 in range(0, tl.minimum(NQ, V - start), QW):
                        r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + c0 + qa)
                        at = start + c0 + qa
                        x = tl.load(x_row + at, mask=at < V, other=float("-inf"))
                        x = tl.where(x >= lo, x, float("-inf"))
                        lg, gi = race_lanes(x, at, V, inv_t, gumbel(r0), t_v, cut, vw, w, lg, gi, True)
                        x = tl.load(x_row + at + NQ, mask=at + NQ < V, other=float("-inf"))
                        x = tl.where(x >= lo, x, float("-inf"))
                        lg, gi = race_lanes(x, at + NQ, V, inv_t, gumbel(r1), t_v, cut, vw, w, lg, gi, True)
                        x = tl.load(x_row + at + 2 * NQ, mask=at + 2 * NQ < V, other=float("-inf"))
                        x = tl.where(x >= lo, x, float("-inf"))
                        lg, gi = race_lanes(x, at + 2 * NQ, V, inv_t, gumbel(r2), t_v, cut, vw, w, lg, gi, True)
                        x = tl.load(x_row + at + 3 * NQ, mask=at + 3 * NQ < V, other=float("-inf"))
                        x = tl.where(x >= lo, x, float("-inf"))
                        lg, gi = race_lanes(x, at + 3 * NQ, V, inv_t, gumbel(r3), t_v, cut, vw, w, lg, gi, True)
                best, bid = first_max(lg, gi, V)
    return w


@triton.jit
def finish_kernel(x_ptr, raw_ptr, par_ptr, pf_ptr, pi_ptr, lanes_ptr, list_ptr, count_ptr, tok_ptr, lp_ptr, V, P,
                  stride_x, stride_raw, BLOCK: tl.constexpr, QW: tl.constexpr, NB: tl.constexpr, NQ: tl.constexpr,
                  PMAX: tl.constexpr, LMAX: tl.constexpr, LSMALL: tl.constexpr, EPS: tl.constexpr, SORT: tl.constexpr,
                  PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    raw_row = raw_ptr + row.to(tl.int64) * stride_raw
    list_row = list_ptr + row.to(tl.int64) * LMAX
    temp, k, top_p, min_p, seed = row_params(par_ptr, row)
    pp = tl.arange(0, PMAX)
    pm = pp < P
    pbase = (row * P + pp) * 4
    m, a = first_max(tl.load(pf_ptr + pbase, mask=pm, other=float("-inf")),
                     tl.load(pi_ptr + (row * P + pp) * 2, mask=pm, other=V), V)  # fmt: skip
    rmax_p = tl.load(pf_ptr + pbase + 1, mask=pm, other=float("-inf"))
    rmax = tl.max(rmax_p, 0)
    rsum_p = tl.load(pf_ptr + pbase + 2, mask=pm, other=0.0)
    lse = rmax + tl.log(tl.sum(rsum_p * tl.exp(rmax_p - tl.where(rmax == float("-inf"), 0.0, rmax)), 0))
    best, bid = first_max(tl.load(pf_ptr + pbase + 3, mask=pm, other=float("-inf")),
                          tl.load(pi_ptr + (row * P + pp) * 2 + 1, mask=pm, other=V), V)  # fmt: skip
    w = a
    if (temp > 0) & (m > float("-inf")):
        inv_t = 1.0 / temp
        has_k = (k < V).to(tl.int32)
        has_p = (top_p < 1.0).to(tl.int32)
        has_min = (min_p > 0.0).to(tl.int32)
        w = tl.where(best == float("-inf"), a, bid)  # no filter: the leader
        if has_k + has_p + has_min > 0:
            listed = 1  # 1: the short list; 0: the rejection rounds; 2: the leader is kept
            tau = float("-inf")
            bound_v = INT_MIN
            bound_id = V
            z = -1.0  # the mass top-p is measured against; negative: the listed top-k's
            if has_k == 1:
                if k <= QW:
                    tau = _kth_lane_max(lanes_ptr + (row * P).to(tl.int64) * QW, P, k, QW, SORT)
                else:
                    listed = 0
            elif has_p - has_min == 1:  # top-p alone: the leader first
                xw = tl.load(x_row + w)
                z, excl, before = _mass_before(x_row, V, m, inv_t, order_value(xw), w, BLOCK)
                if (best == float("-inf")) | (excl == 0.0) | (excl < (top_p - EPS) * z):
                    listed = 2
                else:  # the kept set ends before the leader
                    bound_v = order_value(xw)
                    bound_id = w
                    listed = tl.where(before <= LMAX, 1, 0)
            if has_min * (1 - has_k * has_p) == 1:  # min-p bounds the list, unless top-p needs the whole top-k
                tau = tl.maximum(tau, m + (tl.log(min_p) - 1e-3) * temp)
            if listed == 1:
                n = _compact(x_row, list_row, count_ptr + row, V, tau, bound_v, bound_id, LMAX, BLOCK)
                if (n <= LMAX) & (n > 0):
                    if (has_p - has_k == 1) & (z < 0):  # top-p over the whole vocabulary: Z
                        z = _mass(x_row, V, m, inv_t, INT_MIN, V, BLOCK)
                    if n <= LSMALL:  # a short sort for the usual lists
                        lbest, lw = _list_pick(x_row, list_row, n, m, inv_t, k, top_p, min_p, z, seed, V, NB, NQ,
                                               LSMALL, EPS, SORT)  # fmt: skip
                    else:
                        lbest, lw = _list_pick(x_row, list_row, n, m, inv_t, k, top_p, min_p, z, seed, V, NB, NQ,
                                               LMAX, EPS, SORT)  # fmt: skip
                    w = tl.where(lbest == float("-inf"), a, lw)
                else:
                    listed = 0
            if listed == 0:
                w = _rounds(x_row, V, m, a, best, bid, inv_t, k, top_p, min_p, seed, BLOCK, QW, NB, NQ, EPS)
    tl.store(tok_ptr + row, w.to(tl.int64))
    tl.store(lp_ptr + row, tl.load(raw_row + w) - lse)
