"""Inference-state equivalences (docs/deepseek_v4.md, "Inference state per layer"): decode, chunked prefill and
mixed batches equal one-shot."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from models.tiny_configs import CONFIGS

PAGE = 16
TOL = 1e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest, tiny_dirs: dict) -> DeepseekV4Model:
    path = tiny_dirs[request.param]
    m = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"))
    load_checkpoint(m, path, dtype=torch.float32, progress=False)
    return m


def run(model: DeepseekV4Model, seqs: list[list[int]], plans: list[list[int]]) -> list[torch.Tensor]:
    """Run each sequence by its chunk plan; step k batches the k-th chunk of every sequence that has one."""
    cache = PagedKVCache(model.config, 64 * len(seqs), PAGE)
    states = [SequenceState() for _ in seqs]
    tables = [torch.arange(i * 64, (i + 1) * 64) for i in range(len(seqs))]
    pos, outs = [0] * len(seqs), [[] for _ in seqs]
    for step in range(max(len(p) for p in plans)):
        chunks, toks, who = [], [], []
        for i, plan in enumerate(plans):
            if step < len(plan):
                n = plan[step]
                chunks.append(SeqChunk(states[i], pos[i], n, tables[i]))
                toks.append(seqs[i][pos[i] : pos[i] + n])
                who.append(i)
                pos[i] += n
        batch = ForwardBatch.build(chunks, toks)
        logits = model.logits(model(batch, cache))
        for (a, b), i in zip(batch.offsets(), who):
            outs[i].append(logits[a:b])
    return [torch.cat(o) for o in outs]


def random_seq(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_incremental_decode_equals_full_forward(model: DeepseekV4Model) -> None:
    seq = random_seq(45, 1, model.config.vocab_size)
    full = run(model, [seq], [[45]])[0]
    inc = run(model, [seq], [[3] + [1] * 42])[0]
    assert (full - inc).abs().max().item() < TOL
    assert torch.equal(full.argmax(-1), inc.argmax(-1))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=17), min_size=1, max_size=8))
def test_chunked_prefill_equals_one_shot(model: DeepseekV4Model, cuts: list[int]) -> None:
    n = 41
    seq = random_seq(n, 2, model.config.vocab_size)
    plan, left = [], n
    for c in cuts:
        if left == 0:
            break
        plan.append(min(c, left))
        left -= plan[-1]
    if left:
        plan.append(left)
    full = run(model, [seq], [[n]])[0]
    chunked = run(model, [seq], [plan])[0]
    assert (full - chunked).abs().max().item() < TOL


def test_mixed_prefill_and_decode_step_equals_each_alone(model: DeepseekV4Model) -> None:
    vocab = model.config.vocab_size
    seqs = [random_seq(n, 10 + n, vocab) for n in (37, 20, 9, 1)]
    plans = [[30, 1, 1, 1, 1, 1, 1, 1], [7, 7, 6], [9], [1]]
    mixed = run(model, seqs, plans)
    for s, p, m in zip(seqs, plans, mixed):
        alone = run(model, [s], [[sum(p)]])[0]
        assert (alone - m).abs().max().item() < TOL


def test_window_ring_and_pages_hold_the_state(model: DeepseekV4Model) -> None:
    c = model.config
    seq = random_seq(40, 3, c.vocab_size)
    cache = PagedKVCache(c, 8, PAGE)
    st_ = SequenceState()
    model(ForwardBatch.build([SeqChunk(st_, 0, 40, torch.tensor([5, 2, 7]))], [seq]), cache)
    assert st_.num_tokens == 40
    for layer in range(c.num_hidden_layers):
        assert st_.windows[layer].shape == (c.sliding_window, c.head_dim)
    for layer in c.compressed_layers:
        m = c.ratio(layer)
        rows = cache.read("rows", layer, torch.tensor([5, 2, 7]), 40 // m)
        assert rows.shape == (40 // m, c.head_dim) and rows.abs().sum(-1).gt(0).all()
        untouched = [p for p in range(8) if p not in (5, 2, 7)]
        assert cache.rows[layer][untouched].abs().sum() == 0  # nothing written outside the block table
        key = (layer, "main")
        buf = st_.buffers[key]
        overlap = c.layer_kind(layer) == "csa"
        assert buf.kv.shape[0] == 40 % m + (m if overlap and 40 >= m else 0)


def test_mtp_block_runs_incrementally(model: DeepseekV4Model) -> None:
    """The MTP block over a prompt in one chunk and in five: the same streams at every position, and each chunk's
    logits (its last row's: ``mtp_forward``) those of the one-chunk run's streams there."""
    c, blk = model.config, model.mtp[0]
    seq = random_seq(30, 4, c.vocab_size)

    def mtp(plan: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cache, state, xs, logits, pos = PagedKVCache(c, 8, PAGE), SequenceState(), [], [], 0
        for n in plan:
            batch = ForwardBatch.build([SeqChunk(state, pos, n, torch.arange(8))], [seq[pos : pos + n]])
            h = model(batch, cache)
            x, lg = model.mtp_forward(h, torch.tensor(seq[pos + 1 : pos + n + 1]), batch)
            assert lg.shape == (1, c.vocab_size)
            xs.append(x)
            logits.append(lg)
            pos += n
        return torch.cat(xs), torch.cat(logits)

    plan = [10, 1, 1, 5, 12]
    (full, full_logits), (inc, inc_logits) = mtp([29]), mtp(plan)
    assert full.shape[0] == 29 and torch.isfinite(full).all()
    assert (full - inc).abs().max().item() < TOL
    ends = torch.tensor(plan).cumsum(0) - 1
    assert (model._head(full[ends], blk, blk.norm) - inc_logits).abs().max().item() < TOL
    assert (full_logits - inc_logits[-1:]).abs().max().item() < TOL


def test_quant_sim_rounds_kv_to_fp8_and_changes_logits(model: DeepseekV4Model) -> None:
    c = model.config
    seq = random_seq(24, 5, c.vocab_size)
    plain = run(model, [seq], [[24]])[0]
    model.set_quant_sim(True)
    try:
        sim = run(model, [seq], [[24]])[0]
        state, cache = SequenceState(), PagedKVCache(c, 8, PAGE)
        model(ForwardBatch.build([SeqChunk(state, 0, 24, torch.arange(8))], [seq]), cache)
    finally:
        model.set_quant_sim(False)
    assert torch.isfinite(sim).all() and not torch.allclose(plain, sim)
    nope = state.windows[0][:, : c.head_dim - c.qk_rope_head_dim]
    # every block of the nope dims is e4m3 values times a power of two
    blocks = nope.unflatten(-1, (-1, 16))
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)))
    assert torch.equal((blocks / scale).to(torch.float8_e4m3fn).float() * scale, blocks)
