"""Reference ops in plain torch: the semantics every accelerator kernel is tested against.

Numerics follow the official DeepSeek-V4 inference code (docs/deepseek_v4.md, "Numerics"): fp32 for norms, RoPE,
mHC, attention scores/softmax, routing and MoE accumulation; results cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.quant.cache import fp8_window_round, mxfp4_round, nvfp4_round
from deepinfer.quant.formats import FP8_MAX, dequantize_fp8_blocks, fp4_round, pow2_scale
from deepinfer.quant.native import dequantize_experts
from deepinfer.quant.nibble_order import check_order, plain

_CACHE_ROUNDS = {"fp8": fp8_window_round, "nvfp4": nvfp4_round, "mxfp4": mxfp4_round}  # ReferenceOps.cache_round


class ReferenceOps:
    batch_invariant = False
    native_weights = False  # weights are dequantised at load time; fp8_linear / moe_mxfp4 decode per call

    def __init__(self, device_name: str = "cpu") -> None:
        self.name = device_name

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def parallel(
        self, first: Callable[[], object], second: Callable[[], object], device: torch.device
    ) -> tuple[object, object]:
        return first(), second()

    def logits_linear(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.linear(y.float(), w.float())

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ngk,grk->ngr", x, w)

    def hc_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)

    def hc_expand(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.einsum("tjk,tjd->tkd", comb, res.float())
        return out.to(y.dtype)

    def group_pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        cur: torch.Tensor,
        prev: torch.Tensor | None,
        has_prev: torch.Tensor,
        live: torch.Tensor,
        d: int,
    ) -> torch.Tensor:
        if prev is not None:
            hp = has_prev.view(-1, 1, 1)
            k_all = torch.cat([torch.where(hp, kv[prev][..., :d], 0.0), kv[cur][..., d:]], dim=1)
            s_all = torch.cat([torch.where(hp, score[prev][..., :d], float("-inf")), score[cur][..., d:]], dim=1)
        else:
            k_all, s_all = kv[cur], score[cur]
        return torch.where(live.view(-1, 1), self.softmax_pool(k_all, s_all), 0.0)

    def linear_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float(), w.float())

    def softmax_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        # the softmax over the last dim (a middle-dim softmax on the CPU rounds a row differently with the number of
        # rows): a decode step pools every sequence's group, the per-sequence path only the completed ones
        p = score.transpose(1, 2).softmax(-1).transpose(1, 2)
        return (kv * p).sum(dim=1)

    # reductions the batch-invariant set replaces (ops/invariant.py); everything else is shared
    def _mean_sq(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of squares over the last dim, kept as a size-1 dim."""
        return x.square().mean(-1, keepdim=True)

    def _sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.sum(dim, keepdim=True)

    def _softmax_last(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(self._mean_sq(xf) + eps)
        if weight is not None:
            y = weight.float() * y
        return y.to(x.dtype)

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, inplace: bool = False
    ) -> torch.Tensor:
        rd = cos.shape[-1] * 2
        if inverse:
            sin = -sin
        rot = x[..., -rd:].float().unflatten(-1, (-1, 2))
        even, odd = rot[..., 0], rot[..., 1]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat([x[..., :-rd], out.to(x.dtype)], dim=-1)

    def hc_mixes(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[-2]
        xf = h.flatten(-2).float()
        rs = torch.rsqrt(self._mean_sq(xf) + norm_eps)
        mixes = self.linear(xf, fn.float()) * rs
        scale, base = scale.float(), base.float()
        pre = self.pointwise(torch.sigmoid, mixes[..., :n] * scale[0] + base[:n]) + eps
        if mixes.shape[-1] == n:  # head collapse: pre only
            return pre, pre, pre
        post = 2 * self.pointwise(torch.sigmoid, mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = mixes[..., 2 * n :].unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n)
        comb = self._softmax_last(comb) + eps
        comb = comb / (self._sum(comb, -2) + eps)
        for _ in range(iters - 1):
            comb = comb / (self._sum(comb, -1) + eps)
            comb = comb / (self._sum(comb, -2) + eps)
        return pre, post, comb

    def hc_pre(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre, post, comb = self.hc_mixes(h, fn, scale, base, iters, eps, norm_eps)
        return self.hc_collapse(h, pre), post, comb

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        kf = keys.float()
        s = torch.einsum("nhd,kd->nhk", q.float(), kf) * scale
        s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
        m = torch.maximum(s.amax(-1), sink.float().view(1, -1))
        e = torch.exp(s - m.unsqueeze(-1))
        den = e.sum(-1) + torch.exp(sink.float().view(1, -1) - m)
        p = (e / den.unsqueeze(-1)).to(keys.dtype)
        return torch.einsum("nhk,kd->nhd", p.float(), kf).to(q.dtype)

    def sparse_attention_lists(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        idx: torch.Tensor,
        count: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if paged is not None:
            from deepinfer.kernels.paged_keys import gathered

            keys = gathered(keys, paged)
        t, w = idx.shape
        if w == 0 or keys.shape[0] == 0:
            return torch.zeros_like(q) if out is None else out.zero_()
        valid = torch.arange(w, device=q.device).unsqueeze(0) < count.unsqueeze(1)
        kg = keys.float()[torch.where(valid, idx, 0)]  # [T, W, d]
        s = torch.einsum("thd,twd->thw", q.float(), kg) * scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = torch.maximum(s.amax(-1), sink.float().view(1, -1))
        e = torch.exp(s - m.unsqueeze(-1))
        den = e.sum(-1) + torch.exp(sink.float().view(1, -1) - m)
        p = (e / den.unsqueeze(-1)).to(keys.dtype)
        res = torch.einsum("thw,twd->thd", p.float(), kg).to(q.dtype)
        return res if out is None else out.copy_(res)

    def indexer_scores_ranges(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor,
        start: torch.Tensor,
        width: int,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if paged is not None:
            from deepinfer.kernels.paged_keys import gathered

            keys = gathered(keys, paged)
        n = keys.shape[0]
        if n == 0 or width == 0:
            return torch.zeros(q.shape[0], width, device=q.device)
        r = start.unsqueeze(1) + torch.arange(width, device=q.device)
        kg = keys.float()[r.clamp(max=n - 1)] * (r < n).unsqueeze(-1)  # [T, width, d]
        s = torch.einsum("thd,trd->thr", q.float(), kg).relu()
        return (s * weights.float().unsqueeze(-1)).sum(1)

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        s = torch.einsum("nhd,rd->nhr", q.float(), keys.float()).relu()
        return (s * weights.float().unsqueeze(-1)).sum(1)

    def topk_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        # stable descending sort: equal scores keep ascending index order
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]

    def select_rows(self, scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the chosen visible rows first (a stable sort keeps them ascending), then the rows not chosen, ascending
        top = self.topk_indices(scores, k)
        chosen = torch.zeros_like(visible).scatter_(-1, top, True) & visible
        rows = torch.sort((~chosen).to(torch.uint8), dim=-1, stable=True).indices[..., :k]
        return rows, chosen.sum(-1)

    def moe(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        limit: float,
        act_quant: bool = False,
    ) -> torch.Tensor:
        if act_quant and x.shape[-1] % 128 == 0:
            x = self.act_quant_sim(x, 128)
        fp8_hidden = act_quant and w2.shape[-1] % 128 == 0
        y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            xe = x[rows]
            h = swiglu(self.linear(xe, w1[e]).float(), self.linear(xe, w3[e]).float(), limit, self)
            h = (weights[rows, slot].unsqueeze(-1).float() * h).to(x.dtype)
            if fp8_hidden:
                h = self.act_quant_sim(h, 128)
            y[rows] += self.linear(h, w2[e]).float()  # a token picks an expert at most once
        return y

    def route(
        self, logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.pointwise(F.softplus, logits).sqrt()
        if idx is None:
            idx = self.topk_indices(scores + bias.float() if bias is not None else scores, k)
        w = scores.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True) * scaling

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
        return swiglu(gate.float(), up.float(), limit, self).to(dtype)

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
        if act_quant:
            x = self.act_quant_sim(x, 128)
        return self.linear(x, dequantize_fp8_blocks(w, scale, dtype=x.dtype))

    def fp8_grouped_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        wd = dequantize_fp8_blocks(w, scale, dtype=x.dtype)
        return self.grouped_linear(x, wd.view(x.shape[1], -1, x.shape[-1]))

    def moe_mxfp4(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        s1: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        w3: torch.Tensor,
        s3: torch.Tensor,
        limit: float,
        order: str = "plain",
        act_quant: bool = False,
        refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Decodes only the experts ``idx`` touches, then ``moe`` (``act_quant``: with ``x`` and the hidden rows
        rounded as ``act_quant_sim(·, 128)``, the official FP8 activations, where the width is a multiple of
        128)."""
        check_order(order)
        used, local = torch.unique(idx, return_inverse=True)
        deq = [dequantize_experts(plain(w[used], order), s[used], x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3))]
        return self.moe(x, local.view(idx.shape), weights, *deq, limit, act_quant=act_quant)

    def prepare_weights(self, model: torch.nn.Module) -> None:
        return None

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

    # DeepSeek-V4's decode-step glue (models/deepseek_v4/decode_step.py; kernels/step_glue.py on CUDA)
    def step_indices(
        self,
        meta: torch.Tensor,
        tables: torch.Tensor | None,
        window: int,
        win_width: int,
        ratios: tuple[tuple[int, int, int, bool, bool], ...],
        rings: tuple[tuple[int, int], ...],
        page_size: int,
        scratch_page: int,
    ) -> tuple[tuple, tuple, tuple]:
        slot, pos, floor, live = meta
        s, dev, w = meta.shape[1], meta.device, window
        first = torch.maximum(floor, (pos - w + 1).clamp_min(0))
        base = slot * w
        take = (base.unsqueeze(1) + (pos.unsqueeze(1) - w + 1 + torch.arange(w, device=dev)) % w).flatten()
        count = pos - first + 1
        start = torch.arange(s, device=dev) * w + (w - count)
        lists = start.unsqueeze(1) + torch.arange(win_width, device=dev)
        per_ratio, per_ring, live = [], [], live.bool()
        for m, width, pages, all_rows, visible in ratios:
            r_cnt, r_start = (pos + 1) // m, s * w + torch.arange(s, device=dev) * (pages * (page_size // m))
            vis = torch.arange(width, device=dev).unsqueeze(0) < r_cnt.unsqueeze(1) if visible else None
            idx, cnt = None, None
            if all_rows:
                r_idx = r_start.unsqueeze(1) + torch.arange(width, device=dev)
                idx, cnt = _key_lists(start, count, win_width, r_idx, r_cnt)
            per_ratio.append((r_cnt, r_start, r_start - s * w, vis, idx, cnt))
        for m, cap in rings:
            per_page, ring, lo = page_size // m, (slot * cap).unsqueeze(1), floor.unsqueeze(1)
            g = ((pos + 1) // m - 1).clamp_min(0)
            j = torch.arange(m, device=dev)
            cur = ring + torch.maximum(g.unsqueeze(1) * m + j, lo) % cap
            prev = ring + torch.maximum((g.unsqueeze(1) - 1) * m + j, lo) % cap
            done = live & ((pos + 1) % m == 0)
            page = torch.where(done, tables.gather(1, (g // per_page).unsqueeze(1)).squeeze(1), scratch_page)
            per_ring.append((ring.squeeze(1) + pos % cap, cur, prev, (g > 0).view(-1, 1, 1), g, done, page,
                             g % per_page))  # fmt: skip
        return (first, live, base + pos % w, take, start, count, lists), tuple(per_ratio), tuple(per_ring)

    def key_lists(
        self,
        w_start: torch.Tensor,
        w_cnt: torch.Tensor,
        win_width: int,
        sel: torch.Tensor,
        r_start: torch.Tensor,
        r_cnt: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _key_lists(w_start, w_cnt, win_width, sel + r_start.unsqueeze(1), r_cnt)

    def append_rows(
        self,
        dsts: list[torch.Tensor],
        idxs: list[torch.Tensor],
        srcs: list[torch.Tensor],
        take: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        for d, i, x in zip(dsts, idxs, srcs):
            d.index_copy_(0, i, x.to(d.dtype))
        return None if take is None else torch.index_select(dsts[0], 0, take, out=out)

    def store_rows(
        self,
        store: torch.Tensor,
        page: torch.Tensor,
        row: torch.Tensor,
        rows: torch.Tensor,
        pages: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        store[page, row] = rows.to(store.dtype)
        return torch.index_select(store, 0, pages, out=into)

    def compress_score(
        self, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int
    ) -> torch.Tensor:
        return gate + ape.float()[positions % ratio]

    def moe_combine(self, y: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (y + shared.float()).to(dtype)


def _key_lists(
    w_start: torch.Tensor, w_cnt: torch.Tensor, width: int, r_idx: torch.Tensor, r_cnt: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row its ``w_cnt`` window rows from ``w_start``, then the compressed rows ``r_idx [S, C]`` (pool rows, the
    first ``r_cnt`` valid): ``(idx [S, width + C], count)`` (``ReferenceOps.key_lists``)."""
    c_width = r_idx.shape[1]
    j = torch.arange(width + c_width, device=r_idx.device).unsqueeze(0)
    cw = w_cnt.unsqueeze(1)
    comp = torch.gather(r_idx, 1, (j - cw).clamp(0, max(c_width - 1, 0))) if c_width else torch.zeros_like(j)
    return torch.where(j < cw, w_start.unsqueeze(1) + j, comp), w_cnt + r_cnt


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, ops: ReferenceOps | None = None) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, ±limit)`` (the V4 SwiGLU clamp)."""
    g = gate.clamp(max=limit)
    return (ops.pointwise(F.silu, g) if ops is not None else F.silu(g)) * up.clamp(-limit, limit)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    y = x.float()
    h = 1
    while h < n:
        y = y.unflatten(-1, (-1, 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)
