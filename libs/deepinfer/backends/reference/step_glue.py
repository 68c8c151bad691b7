"""The reference DeepSeek-V4 decode-step glue (``models/deepseek_v4/decode_step.py``; ``kernels/step_glue.py`` on CUDA):
the step plan's index arithmetic, ring appends and page writes, in plain torch."""

from __future__ import annotations

import torch


class ReferenceStepGlueOps:
    """``step_indices``, ``key_lists``, ``append_rows``, ``store_rows``, ``compress_score`` and ``moe_combine`` of
    :class:`ReferenceOps <deepinfer.backends.reference.ops.ReferenceOps>` (a mixin; the ``Ops`` protocol documents
    them)."""

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
