"""``NvidiaOps``' DeepSeek-V4 decode-step glue (``models/deepseek_v4/decode_step.py``): on CUDA one Triton launch each
(``deepinfer.kernels.step_glue``, ``step_glue_rows``: the reference's values bit for bit) where ``step_glue.fits``
takes the arguments' layouts, the reference (the next class in the op set's MRO) elsewhere. A mixin, kept apart from
``ops.py``; importing it imports no Triton.
"""

from __future__ import annotations

import torch


class StepGlueOps:
    """``step_indices``, ``key_lists``, ``append_rows``, ``store_rows``, ``compress_score`` and ``moe_combine`` (the
    ``Ops`` protocol documents them) for an op set deriving from ``ReferenceOps`` (``class NvidiaOps(StreamOps,
    StepGlueOps, NvidiaMoEOps, ReferenceOps)``)."""

    def _glue(self, name: str, *args: object) -> object:
        from deepinfer.kernels import step_glue

        if step_glue.fits(name, *args):
            return getattr(step_glue, name)(*args)
        return getattr(super(), name)(*args)

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
        return self._glue("step_indices", meta, tables, window, win_width, ratios, rings, page_size, scratch_page)

    def key_lists(
        self,
        w_start: torch.Tensor,
        w_cnt: torch.Tensor,
        win_width: int,
        sel: torch.Tensor,
        r_start: torch.Tensor,
        r_cnt: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._glue("key_lists", w_start, w_cnt, win_width, sel, r_start, r_cnt)

    def append_rows(
        self,
        dsts: list[torch.Tensor],
        idxs: list[torch.Tensor],
        srcs: list[torch.Tensor],
        take: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        return self._glue("append_rows", dsts, idxs, srcs, take, out)

    def store_rows(
        self,
        store: torch.Tensor,
        page: torch.Tensor,
        row: torch.Tensor,
        rows: torch.Tensor,
        pages: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._glue("store_rows", store, page, row, rows, pages, into)

    def compress_score(
        self, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int
    ) -> torch.Tensor:
        return self._glue("compress_score", gate, ape, positions, ratio)

    def moe_combine(self, y: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._glue("moe_combine", y, shared, dtype)


__all__ = ["StepGlueOps"]
