"""The reference sparse attention, the compressors' pooling and the lightning indexer's scores and top-k."""

from __future__ import annotations

import torch


class ReferenceAttentionOps:
    """The attention ops of :class:`ReferenceOps <deepinfer.backends.reference.ops.ReferenceOps>` (a mixin): sparse
    attention over a mask or per-query key lists, the compressors' softmax pooling, the indexer's scores, and the
    stable top-k / row selection (ties to the lower index)."""

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

    def softmax_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        # the softmax over the last dim (a middle-dim softmax on the CPU rounds a row differently with the number of
        # rows): a decode step pools every sequence's group, the per-sequence path only the completed ones
        p = score.transpose(1, 2).softmax(-1).transpose(1, 2)
        return (kv * p).sum(dim=1)

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
