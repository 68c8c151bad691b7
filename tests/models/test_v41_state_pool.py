"""DeepSeek-V4.1 decode steps on pooled state (the model's ``StatePool``: window rings in
``attention_batched._window_pooled``, the ratio-2 compressors' pending pairs in ``Compressor.latents_pooled``): the
same logits, bit for bit, as the per-sequence state, through prefill chunks, decodes past the window and across pair
boundaries, a mixed step, a bounded decoder replay (decoder layers whose window starts later), more sequences than
the pool's first size, and slots given back."""

from __future__ import annotations

import gc

import pytest
import torch

from deepinfer.models.deepseek_v4.state import ForwardBatch, PagedKVCache, SeqChunk, SequenceState
from deepinfer.models.deepseek_v4.state_pool import PooledBuffer
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from models.test_v41_decoder_replay import _model
from models.tiny_v41 import build_tokenizer

N_SEQ, PAGES = 10, 24  # 10 sequences: the pool (8 slots at first) grows once


@pytest.fixture(scope="module")
def model():
    return _model(build_tokenizer(), "sketch", seed=3)


def _run(model: DeepseekV41Model, pooled: bool) -> torch.Tensor:
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
        assert pool.bufs and all(type(b) is PooledBuffer for st in states for b in st.buffers.values())
        states.clear()
        gc.collect()
        assert sorted(pool.free + [pool.scratch]) == list(range(16))  # every slot given back (but the scratch one)
    return torch.cat(out)


def test_pooled_windows_give_the_same_logits(model):
    assert model.text.sliding_window < 20  # the decodes run past the window
    per_sequence = _run(model, pooled=False)
    pooled = _run(model, pooled=True)
    assert torch.equal(per_sequence, pooled)
