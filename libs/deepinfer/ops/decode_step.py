"""The DeepSeek-V4 family's decode-step glue (:class:`DecodeStepOps`): the index arithmetic and copies of one
pooled decode step (``models/deepseek_v4/decode_step.py``, ``models/deepseek_v41/decode_step.py``): every index
tensor of the step from its metadata and block tables, each row's key list, a layer's ring appends and a compressor's
stored rows. All exact, all capturable (pure functions of their inputs with shapes from host ints), so a decode step
can be one CUDA graph. Used by DeepSeek-V4 and V4.1 only.
"""

from __future__ import annotations

from typing import Protocol

import torch


class DecodeStepOps(Protocol):
    """The decode step's index and copy glue (module docstring): DeepSeek-V4 and V4.1."""

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
        """Every index tensor of a decode step (``decode_step.V4DecodePlan``) from ``meta [4, S]`` (slot, position,
        window start ``floor``, liveness; int64) and the block tables ``[S, P]`` (None without ``ratios`` and
        ``rings``):

        * the window ``(first, live, put, take, start, count, idx)``: the first window position ``max(floor, pos -
          window + 1, 0)``, ``live`` bool, the new row's ring row ``slot·window + pos % window``, the ring rows in
          position order ``take [S·window]``, each row's window rows in the gathered pool (``start``, ``count``) and
          its key list ``idx [S, win_width]`` (``start + j``);
        * per ratio ``(m, rows, pages, lists, visible)``: ``(count, r_start, i_start, visible, idx, cnt)``: the
          visible compressed rows ``(pos + 1) // m``, row 0 of each row's ``pages · page_size / m`` gathered rows
          after the ``S·window`` window rows (``r_start``; ``i_start`` without the window rows), the bool mask
          ``visible [S, rows]`` (``r < count``; None unless asked) and the all-rows key lists ``key_lists`` of rows
          ``r_start + r``, ``r < rows`` (None unless ``lists``);
        * per ring ``(m, cap)``: ``(at, cur, prev, has_prev, w, done, page, row)``: the new projections' ring row,
          the groups ``cur``, ``prev [S, m]`` (ring rows of positions ``w·m + j`` and ``(w - 1)·m + j``, never below
          ``floor``) of the last group ``w = max((pos + 1) // m - 1, 0)``, ``has_prev [S, 1, 1]`` (``w > 0``),
          ``done`` (live and completing a group), the page its row goes to (``tables[s, w // (page_size / m)]``,
          ``scratch_page`` unless ``done``) and the row in it.

        Int64 outputs, bool masks; a pure function of its inputs with shapes from the host ints (capturable)."""
        ...

    def key_lists(
        self,
        w_start: torch.Tensor,
        w_cnt: torch.Tensor,
        win_width: int,
        sel: torch.Tensor,
        r_start: torch.Tensor,
        r_cnt: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row its key list ``[S, win_width + C]``: its ``w_cnt`` window rows ``w_start + j``, then the compressed
        rows ``sel [S, C] + r_start`` (the first ``r_cnt`` valid); entry ``j ≥ w_cnt`` is ``sel[s, min(j - w_cnt, C -
        1)] + r_start[s]`` (0 when ``C = 0``); and the counts ``w_cnt + r_cnt``."""
        ...

    def append_rows(
        self,
        dsts: list[torch.Tensor],
        idxs: list[torch.Tensor],
        srcs: list[torch.Tensor],
        take: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``dst.index_copy_(0, idx, src.to(dst.dtype))`` for every ``(dst, idx, src)`` (a layer's ring appends), then,
        with ``take``, ``index_select(dsts[0], 0, take, out=out)`` (its window rows; ``take [S·k]`` holds ``k`` entries
        per row of ``idxs[0]``). Where two rows write one row (padding rows), any of them may win, and a ``take``
        entry naming another row's new row may read the old value; a row's own new row is always the new value."""
        ...

    def store_rows(
        self,
        store: torch.Tensor,
        page: torch.Tensor,
        row: torch.Tensor,
        rows: torch.Tensor,
        pages: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``store[page, row] = rows.to(store.dtype)`` (``store [N, R, D]``, ``page``, ``row``, ``rows`` per row
        ``s < S``), then ``index_select(store, 0, pages, out=into)`` (``pages [S·P]``: row ``s``'s pages ``s·P ..``):
        a compressor's new rows stored and every row's pages gathered. As in ``append_rows``, a gathered row that
        another row writes may read the old value; a row's own written row, in its own pages, is the new value."""
        ...
