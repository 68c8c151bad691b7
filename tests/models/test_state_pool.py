"""Decode steps on pooled state (``models.deepseek_v4.state_pool``): the same logits, bit for bit, as the per-sequence
bookkeeping, through prefill chunks, decodes across compressor row boundaries, mixed steps, a bounded replay, a
snapshot taken and resumed, more sequences than the pool's first size, and slots given back."""

from __future__ import annotations

import gc

import torch

from deepinfer.backends.reference import ReferenceOps
from deepinfer.checkpoint.tiny import TINY_V4, random_weights
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState, StateSnapshot
from deepinfer.models.deepseek_v4.state_pool import RingBuffer, stacked_rows
from models.test_batch_invariance import tokens

N_SEQ, PAGES = 11, 6  # 11 sequences: the pool (8 slots at first) grows once


def _model() -> DeepseekV4Model:
    config = DeepseekV4Config.from_dict(TINY_V4)
    model = DeepseekV4Model(config, ReferenceOps())
    model.load_state_dict(random_weights(config, seed=7))
    return model


def _run(model: DeepseekV4Model, pooled: bool) -> tuple[torch.Tensor, DeepseekV4Model]:
    model.pooled_decode = pooled
    cache = PagedKVCache(model.config, N_SEQ * PAGES, 16)
    vocab = model.config.vocab_size
    seqs = [tokens(70, 100 + i, vocab) for i in range(N_SEQ)]
    states = [SequenceState() for _ in seqs]
    tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(N_SEQ)]
    out = []

    def step(plan: dict[int, int]) -> None:
        chunks = [SeqChunk(states[i], states[i].num_tokens, n, tables[i]) for i, n in plan.items()]
        ids = [seqs[i][c.start : c.end] for i, c in zip(plan, chunks)]
        out.append(model.logits(model(ForwardBatch.build(chunks, ids), cache)))

    step({i: 5 + i for i in range(N_SEQ)})  # prefill chunks of 5..15 tokens
    for _ in range(9):  # decodes of everyone: compressor rows complete (ratios 4 and 8) at different steps
        step(dict.fromkeys(range(N_SEQ), 1))
    step({0: 1, 1: 3, 2: 1, 3: 1})  # a mixed step: the per-sequence path on pooled states
    for _ in range(4):
        step(dict.fromkeys(range(N_SEQ), 1))
    # a bounded replay of sequence 4 from a compact snapshot, then a full snapshot of sequence 5 resumed
    snap = StateSnapshot.take(states[4], cache, tables[4], compact=True)
    states[4] = snap.restore_replay(cache, tables[4], "cpu", states[4].num_tokens - 6)
    step({4: 6})
    full = StateSnapshot.take(states[5], cache, tables[5])
    states[5] = full.restore(cache, tables[5], "cpu")
    for _ in range(5):
        step(dict.fromkeys(range(N_SEQ), 1))
    if pooled:
        assert all(type(b) is RingBuffer for st in states for b in st.buffers.values())
    states.clear()  # every state gone: their slots go back to the pool
    return torch.cat(out), model


def test_pooled_decode_gives_the_same_logits():
    model = _model()
    want, _ = _run(model, pooled=False)
    assert model.state_pool is None
    got, model = _run(model, pooled=True)
    assert torch.equal(got, want)
    pool = model.state_pool
    assert pool.capacity == 16  # grown from 8
    gc.collect()
    assert len(pool.free) == pool.capacity - 1  # every state gone: every slot but the scratch one given back


def test_an_mtp_block_in_the_same_step_gets_its_own_plan():
    """A decode step shares its window plan and attention metadata among its layers (``StatePool.memo``); an MTP
    block run in the same step on other positions (here 0, 1, ...: it has not run since the prefill) builds its own.
    Its logits equal those of the per-sequence state, bit for bit."""
    model = _model()
    vocab = model.config.vocab_size

    def run(pooled: bool) -> torch.Tensor:
        model.pooled_decode = pooled
        cache = PagedKVCache(model.config, 3 * PAGES, 16)
        seqs = [tokens(40, 300 + i, vocab) for i in range(3)]
        states = [SequenceState() for _ in seqs]
        tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(3)]
        out = []
        for n in (20, 1, 1, 1):
            chunks = [SeqChunk(s, s.num_tokens, n, t) for s, t in zip(states, tables)]
            batch = ForwardBatch.build(chunks, [q[c.start : c.end] for q, c in zip(seqs, chunks)])
            h = model(batch, cache)
            out.append(model.logits(h))
            if n == 1:
                nxt = torch.tensor([q[c.end] for q, c in zip(seqs, chunks)])
                out.append(model.mtp_forward(h, nxt, batch)[1])
        assert [s.mtp_tokens for s in states] == [3, 3, 3]  # the block ran on positions 0, 1, 2
        return torch.cat(out)

    assert torch.equal(run(pooled=True), run(pooled=False))


def test_stacked_rows_views_the_matrix_the_tables_are_rows_of():
    """The block tables of a step as one ``[B, P]`` matrix: the worker's zero-padded matrix itself when the tables
    are leading slices of its consecutive rows (no copy), else a copy; always what ``pad_sequence`` gives, padding
    aside (a view keeps the matrix's own padding)."""
    lens = [3, 5, 2]
    padded = torch.tensor([[*range(10 * i, 10 * i + n), *[0] * (5 - n)] for i, n in enumerate(lens)])
    rows = [row[:n] for row, n in zip(padded, lens)]
    ref = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    got = stacked_rows(rows)
    assert torch.equal(got, ref) and got.data_ptr() == padded.data_ptr()  # a view
    assert stacked_rows(rows[1:]).data_ptr() == padded[1].data_ptr()  # from a later row on
    for other in ([rows[0], rows[2]], [rows[1], rows[0]], [r.clone() for r in rows]):  # not consecutive rows: a copy
        got = stacked_rows(other)
        assert torch.equal(got, torch.nn.utils.rnn.pad_sequence(other, batch_first=True))
        assert got.data_ptr() != padded.data_ptr()
    col = padded[:, 0]  # starts where row 0 starts, but strided: a copy
    assert stacked_rows([col]).tolist() == [col.tolist()]
    wide = padded.view(torch.int32)[1:2, :4]  # row 1's memory as another dtype
    assert torch.equal(stacked_rows([wide[0]]), wide)
    same = [torch.arange(4) + i for i in range(3)]  # equal lengths: stacked
    assert torch.equal(stacked_rows(same), torch.stack(same))


def test_write_many_is_each_write():
    """One scatter for several sequences' rows (prefill-sized and decode-sized writes) stores what a ``write`` per
    sequence stores."""
    cfg = DeepseekV4Config.from_dict(dict(TINY_V4))
    layer = next(i for i, r in enumerate(cfg.compress_ratios) if r)
    a, b = PagedKVCache(cfg, 12, 16), PagedKVCache(cfg, 12, 16)
    g = torch.Generator().manual_seed(0)
    dim = a.rows[layer].shape[-1]
    writes = [(torch.tensor([3, 7, 1]), 0, torch.randn(9, dim, generator=g)),
              (torch.tensor([4, 0]), 5, torch.randn(1, dim, generator=g)),
              (torch.tensor([11, 2, 9, 8]), 2, torch.randn(0, dim, generator=g)),
              (torch.tensor([5, 6]), 1, torch.randn(2, dim, generator=g))]  # fmt: skip
    a.write_many("rows", layer, writes)
    for table, first, rows in writes:
        b.write("rows", layer, table, first, rows)
    assert torch.equal(a.rows[layer], b.rows[layer])
