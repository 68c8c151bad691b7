"""The reference RMSNorm, RoPE and mHC (manifold-constrained hyper-connections): fp32 throughout, results cast back to
the input dtype (docs/deepseek_v4.md, "Numerics")."""

from __future__ import annotations

import torch


class ReferenceNormOps:
    """``rms_norm``, ``rope``, ``hc_mixes`` / ``hc_pre`` / ``hc_collapse`` / ``hc_expand`` of :class:`ReferenceOps
    <deepinfer.backends.reference.ops.ReferenceOps>` (a mixin: it calls the op set's ``linear`` and ``pointwise``), and
    the three reductions under them that the batch-invariant set replaces."""

    # reductions the batch-invariant set replaces (backends/reference/invariant.py); everything else is shared
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

    def hc_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)

    def hc_expand(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.einsum("tjk,tjd->tkd", comb, res.float())
        return out.to(y.dtype)
