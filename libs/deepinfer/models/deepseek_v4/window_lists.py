"""Each token's window rows in a batched (prefill or mixed) step of ``DeepseekV4Model``'s attention.

The window pool of a step (``Attention._attend_batched``) holds, per chunk, the ring's rows older than the chunk (from
``first = max(window_start, start - window + 1, 0)``, none before a bounded replay's start) and then the chunk's new
rows. Token ``t`` of a chunk attends to the pool rows of positions ``max(t - window + 1, first) .. t``. Every layer of
a step has the same window, so these lists depend only on the chunks: they are built once per forward
(``StatePool.memo``) on the host, copied to the device once, and the sliding-window layers' key lists ``[T, width]``
are made once on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.deepseek_v4.forward_batch import SeqChunk
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.runtime.host_copy import to_device


@dataclass
class WindowLists:
    """Host lists of a step: per chunk the first pool position ``lo`` and its rows' offset in the pool ``woff``; per
    token its chunk ``cid``, position ``pos``, first pool row ``w_start`` and row count ``w_cnt`` (``width``: the
    largest). ``device(dev)``: ``(idx [T, width], count [T])`` on ``dev``, made once."""

    lo: list[int]
    woff: list[int]
    cid: torch.Tensor
    pos: torch.Tensor
    w_start: torch.Tensor
    w_cnt: torch.Tensor
    width: int
    _device: tuple[torch.Tensor, torch.Tensor] | None = None

    def select(self, rows: torch.Tensor) -> WindowLists:
        """The lists of the tokens ``rows`` only (the window pool unchanged: context parallelism's queries)."""
        rows = rows.cpu()
        return WindowLists(self.lo, self.woff, self.cid[rows], self.pos[rows], self.w_start[rows], self.w_cnt[rows],
                           self.width)  # fmt: skip

    def device(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._device is None or self._device[0].device != dev:
            start_d, cnt = to_device(torch.stack([self.w_start, self.w_cnt]), dev)
            self._device = start_d.unsqueeze(1) + torch.arange(self.width, device=dev), cnt
        return self._device


def window_lists(chunks: list[SeqChunk], offsets: list[tuple[int, int]], window: int) -> WindowLists:
    """The step's ``WindowLists`` (module docstring), from the chunks alone. The per-token lists in numpy: a dozen
    torch ops on the host cost ~20 µs each whatever their size, numpy's a few for a 4096-token prompt."""
    lo, woff, o = [], [], 0
    for chunk, (a, b) in zip(chunks, offsets):
        first = max(chunk.state.window_start, chunk.start - window + 1, 0)  # a replay sees no older rows
        lo.append(first)
        woff.append(o)
        o += chunk.start - first + b - a
    lens = np.array([b - a for a, b in offsets], dtype=np.int64)
    cid = np.repeat(np.arange(len(chunks), dtype=np.int64), lens)
    # a token's position: its chunk's start plus its index in the chunk
    shift = np.array([c.start - a for c, (a, _) in zip(chunks, offsets)], dtype=np.int64)
    pos = np.arange(cid.shape[0], dtype=np.int64) + shift[cid]
    lo_t = np.array(lo, dtype=np.int64)[cid]
    w_first = np.maximum(pos - window + 1, lo_t)
    w_start, w_cnt = np.array(woff, dtype=np.int64)[cid] + (w_first - lo_t), pos - w_first + 1
    width = int(w_cnt.max()) if w_cnt.size else 0
    t = torch.from_numpy
    return WindowLists(lo, woff, t(cid), t(pos), t(w_start), t(w_cnt), width)


def step_window_lists(
    pool: StatePool | None, chunks: list[SeqChunk], offsets: list[tuple[int, int]], window: int
) -> WindowLists:
    """``window_lists`` once per forward through ``pool``'s memo (every call without a pool)."""
    if pool is None:
        return window_lists(chunks, offsets, window)
    return pool.memo(chunks, ("window_lists", window), lambda: window_lists(chunks, offsets, window))


__all__ = ["WindowLists", "step_window_lists", "window_lists"]
