"""DeepSeek-V4.1 decode steps on pooled state (the model's ``StatePool``: window rings and the ratio-2 compressors'
rings, ``decode_step.attend`` in fixed shapes from a ``V41DecodePlan``): the same logits, bit for bit, as the
per-sequence state, through prefill chunks, decodes past the window and across pair boundaries, a mixed step (the
per-sequence code on pooled states), a bounded decoder replay (decoder layers whose window starts later), more
sequences than the pool's first size, and slots given back."""

from __future__ import annotations

import gc

import pytest
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v4.state_pool import RingBuffer
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from models.test_v41_decoder_replay import _model
from models.tiny_v41 import build_tokenizer

N_SEQ, PAGES = 10, 24  # 10 sequences: the pool (8 slots at first) grows once


@pytest.fixture(scope="module")
def model():
    return _model(build_tokenizer(), "sketch", seed=3)


def _run(model: DeepseekV41Model, pooled: bool) -> tuple[torch.Tensor, PagedKVCache]:
    model.pooled_decode = pooled
    cache = PagedKVCache(model.config, N_SEQ * PAGES, 8)
    vocab = model.config.text_config.vocab_size
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, vocab, (160,), generator=g).tolist() for _ in range(N_SEQ)]
    states = [SequenceState() for _ in seqs]
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(N_SEQ)]
    out = []

    def step(plan: dict[int, int], decoder_from: dict[int, int] | None = None) -> None:
        chunks = [SeqChunk(states[i], states[i].num_tokens, n, tables[i], (decoder_from or {}).get(i))
                  for i, n in plan.items()]  # fmt: skip
        ids = [seqs[i][c.start : c.end] for i, c in zip(plan, chunks)]
        out.append(model.logits(model(ForwardBatch.build(chunks, ids), cache)))

    step({i: 20 + 7 * i for i in range(N_SEQ)}, {3: 40})  # prefills; sequence 3's decoder starts at 40
    for _ in range(12):
        step(dict.fromkeys(range(N_SEQ), 1))
    step({0: 3, 1: 5, 2: 1})  # a mixed step: the per-sequence code on pooled states (0 after a pair, 1 inside one)
    for _ in range(6):
        step(dict.fromkeys(range(N_SEQ), 1))
    if pooled:
        pool = model.state_pool
        assert pool.capacity == 16 and all(st.pool_slot[0] is pool for st in states)
        assert pool.rbufs and all(type(b) is RingBuffer for st in states for b in st.buffers.values())
        states.clear()
        gc.collect()
        assert sorted(pool.free + [pool.scratch]) == list(range(16))  # every slot given back (but the scratch one)
    return torch.cat(out), cache


def test_pooled_windows_give_the_same_logits(model):
    assert model.text.sliding_window < 20  # the decodes run past the window
    per_sequence, ca = _run(model, pooled=False)
    pooled, cb = _run(model, pooled=True)
    assert torch.equal(per_sequence, pooled)
    for kind, layer in ca.stores():  # the compressed rows and index keys too (the pooled step writes every row)
        assert torch.equal(ca._store(kind, layer)[: ca.num_pages], cb._store(kind, layer)[: cb.num_pages]), kind


def test_one_completed_pair_in_a_step_without_rounding(model):
    """Two sequences of other parities, the cache formats' rounding off: each decode step completes one ratio-2 pair,
    whose index key the per-sequence path projects alone while the pooled step projects every sequence's; both give
    the same keys (``Indexer.keys``' ``rowwise``: a GEMM's rows round with the number of rows), logits and pages."""

    def run(pooled: bool) -> tuple[torch.Tensor, PagedKVCache]:
        model.pooled_decode = pooled
        cache, g = PagedKVCache(model.config, 48, 8), torch.Generator().manual_seed(5)
        states, tables, out = [SequenceState(), SequenceState()], [torch.arange(24), torch.arange(24, 48)], []
        for st, table, n in zip(states, tables, (20, 27)):
            ids = torch.randint(5, 60, (n,), generator=g).tolist()
            model(ForwardBatch.build([SeqChunk(st, 0, n, table)], [ids]), cache)
        for _ in range(8):
            chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
            out.append(model.logits(model(ForwardBatch.build(chunks, [[9], [11]]), cache)))
        return torch.cat(out), cache

    model.set_quant_sim(False)
    try:
        (a, ca), (b, cb) = run(False), run(True)
    finally:
        model.set_quant_sim(True)
    assert torch.equal(a, b)
    for kind, layer in ca.stores():
        assert torch.equal(ca._store(kind, layer)[: ca.num_pages], cb._store(kind, layer)[: cb.num_pages]), kind
