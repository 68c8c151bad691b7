"""Each token's window rows in a batched step (``deepinfer.models.deepseek_v4.window_lists``): the lists against a
direct enumeration, and built once per forward."""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.forward_batch import SeqChunk
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.state_pool import StatePool
from deepinfer.models.deepseek_v4.window_lists import step_window_lists, window_lists


def _chunks():
    fresh = SequenceState()
    later = SequenceState(num_tokens=10)
    replay = SequenceState(num_tokens=12, window_start=9)  # a bounded replay: no rows before position 9
    chunks = [SeqChunk(fresh, 0, 5, None), SeqChunk(later, 10, 3, None), SeqChunk(replay, 12, 2, None)]
    offsets, o = [], 0
    for c in chunks:
        offsets.append((o, o + c.length))
        o += c.length
    return chunks, offsets


def test_the_lists_are_each_tokens_window_in_the_pool():
    win = 4
    chunks, offsets = _chunks()
    wl = window_lists(chunks, offsets, win)
    assert wl.lo == [0, 7, 9] and wl.width == 4
    # the pool: per chunk its old rows from lo, then its new rows; a token's rows are the positions of its window
    pool_pos = []
    for c, first in zip(chunks, wl.lo):
        pool_pos += list(range(first, c.start)) + list(range(c.start, c.end))
    assert wl.woff == [0, 5, 11]
    t = 0
    for i, c in enumerate(chunks):
        for p in range(c.start, c.end):
            rows = pool_pos[wl.w_start[t] : wl.w_start[t] + wl.w_cnt[t]]
            assert rows == list(range(max(p - win + 1, wl.lo[i]), p + 1)), (i, p, rows)
            assert wl.pos[t] == p and wl.cid[t] == i
            t += 1
    idx, cnt = wl.device(torch.device("cpu"))
    assert torch.equal(cnt, wl.w_cnt) and torch.equal(idx[:, 0], wl.w_start) and idx.shape == (t, 4)


def test_the_lists_are_built_once_per_forward():
    chunks, offsets = _chunks()
    pool = StatePool("cpu")
    pool.begin_step()
    first = step_window_lists(pool, chunks, offsets, 4)
    assert step_window_lists(pool, chunks, offsets, 4) is first
    assert step_window_lists(pool, chunks, offsets, 8) is not first  # another window, other lists
    assert first.device(torch.device("cpu")) is first.device(torch.device("cpu"))
    pool.end_step()
    assert step_window_lists(pool, chunks, offsets, 4) is not first
    assert step_window_lists(None, chunks, offsets, 4) is not step_window_lists(None, chunks, offsets, 4)
