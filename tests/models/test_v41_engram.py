"""Engram hashing of DeepSeek-V4.1 against NeMo AutoModel's ``engram`` module; incremental == full."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.engram import EngramHasher, bucket_primes, compressed_token_map
from models.tiny_v41 import NAMES, build_tokenizer, text_config


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _pair(nemo, name, tokenizer):
    raw = text_config(name, tokenizer)
    ours = EngramHasher(DeepseekV41TextConfig.from_dict(raw), compressed_token_map(tokenizer)[0])
    theirs_cfg = nemo["config"].DeepseekV41TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    theirs = nemo["engram"].DeepseekV41NgramHash(theirs_cfg, tokenizer)
    return ours, theirs


def test_v41_compressed_vocab_parity(nemo, tokenizer):
    ours = compressed_token_map(tokenizer)
    assert ours == (
        list(nemo["engram"]._compressed_token_map(tokenizer)[0]),
        nemo["engram"]._compressed_token_map(tokenizer)[1],
    )
    token_map, size = ours
    ids = tokenizer.convert_tokens_to_ids
    assert token_map[ids("Hello")] == token_map[ids("hello")] == token_map[ids("HELLO")]
    assert token_map[ids("Ünï")] == token_map[ids("uni")] and token_map[ids("Crème")] == token_map[ids("creme")]
    assert token_map[ids("Ｗ3")] == token_map[ids("w3")]
    assert size == len(set(token_map)) < len(tokenizer)
    assert compressed_token_map(tokenizer.backend_tokenizer) == ours  # a bare tokenizers.Tokenizer works too


@pytest.mark.parametrize("name", NAMES)
def test_v41_engram_hash_parity(nemo, tokenizer, name):
    ours, theirs = _pair(nemo, name, tokenizer)
    assert ours.primes.tolist() == theirs.primes.tolist()
    assert ours.offsets.tolist() == theirs.offsets.tolist()
    assert ours.multipliers.tolist() == theirs.multipliers.tolist()
    assert ours.pad_id == theirs.pad_id
    g = torch.Generator().manual_seed(len(name))
    for batch, seq in ((1, 1), (3, 17), (2, 64)):
        ids = torch.randint(0, len(tokenizer), (batch, seq), generator=g)
        expected = theirs(ids)
        assert expected.shape == (batch, seq, len(ours.layer_ids), ours.primes.shape[1])
        assert torch.equal(ours.hash(ids), expected)
        mask = torch.rand(batch, seq, generator=g) > 0.15  # image / padding tokens block the lookback
        assert torch.equal(ours.hash(ids, mask), theirs(ids, token_mask=mask))
    rows = torch.tensor(text_config(name, tokenizer)["engram_num_embeddings"])
    assert bool((ours.hash(ids) < rows.view(-1, 1)).all())


@pytest.mark.parametrize("name", NAMES)
def test_v41_engram_incremental_equals_full(nemo, tokenizer, name):
    ours, _ = _pair(nemo, name, tokenizer)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, len(tokenizer), (2, 40), generator=g)
    mask = torch.rand(2, 40, generator=g) > 0.1
    full = ours.hash(ids, mask)
    for cuts in ([1] * 40, [5, 1, 1, 9, 2, 22], [3, 37], [40]):
        history, pos, parts = ours.empty_history(2), 0, []
        for n in cuts:
            chunk, m = ids[:, pos : pos + n], mask[:, pos : pos + n]
            parts.append(ours.hash(chunk, m, history))
            history = ours.next_history(history, chunk, m)
            assert history.shape == (2, ours.max_ngram_size - 1)  # the whole per-sequence state
            pos += n
        assert torch.equal(torch.cat(parts, dim=1), full), cuts


@pytest.mark.parametrize("name", NAMES)
def test_v41_engram_numpy_step_equals_hash(nemo, tokenizer, name):
    """The decode step's numpy hashing (``EngramHasher.step``) gives ``hash``'s rows and ``next_history``'s state for
    one token at a time, bit for bit, masked tokens included (the rows are checked against NeMo above)."""
    ours, _ = _pair(nemo, name, tokenizer)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, len(tokenizer), (3, 30), generator=g)
    ids[0, :4] = torch.tensor([len(tokenizer) - 1, 0, 0, 1])
    mask = torch.rand(3, 30, generator=g) > 0.2
    full = ours.hash(ids, mask)
    history, hist_np = ours.empty_history(3), ours.empty_history(3).numpy()
    for pos in range(30):
        rows, hist_np = ours.step(ids[:, pos].numpy(), hist_np, mask[:, pos].numpy())
        history = ours.next_history(history, ids[:, pos : pos + 1], mask[:, pos : pos + 1])
        assert rows.dtype == np.int64 and np.array_equal(rows, full[:, pos].numpy()), pos
        assert np.array_equal(hist_np, history.numpy()), pos
    rows, _ = ours.step(ids[:, 0].numpy(), hist_np)  # no mask: every token is text
    assert np.array_equal(rows, ours.hash(ids[:, :1], None, history)[:, 0].numpy())
    with pytest.raises(ValueError, match="Engram input ids"):
        ours.step(np.array([len(tokenizer)]), hist_np[:1])


def test_v41_engram_flash_table_sizes():
    """The released table sizes are the prime sums (layers 1 then 14, shared `seen` set)."""
    c = DeepseekV41TextConfig()
    primes = bucket_primes(c.engram_layer_ids, c.engram_vocab_size, c.engram_n_heads, c.engram_max_ngram_size)
    assert [len(p) for p in primes] == [24, 24]
    assert [sum(p) for p in primes] == list(c.engram_num_embeddings) == [384006168, 384016682]


def test_v41_engram_rejects_bad_inputs(tokenizer):
    raw = text_config("sketch", tokenizer)
    token_map = compressed_token_map(tokenizer)[0]
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(DeepseekV41TextConfig.from_dict(dict(raw, engram_compressed_vocab_size=5)), token_map)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHasher(DeepseekV41TextConfig.from_dict(dict(raw, engram_num_embeddings=[10, 10])), token_map)
    h = EngramHasher(DeepseekV41TextConfig.from_dict(raw), token_map)
    with pytest.raises(ValueError, match="input ids"):
        h.hash(torch.tensor([[len(tokenizer)]]))
    with pytest.raises(ValueError, match="history"):
        h.hash(torch.tensor([[3]]), history=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("name", ["sketch", "heads8"])
def test_v41_engram_update_parity(nemo, tokenizer, name):
    """Lookup + gated residual update vs NeMo's DeepseekV41Engram (fp32, random weights)."""
    from nemo_automodel.components.models.common import BackendConfig

    from deepinfer.models.deepseek_v41.engram import engram_update

    raw = dict(text_config(name, tokenizer), dtype="float32")
    cfg = DeepseekV41TextConfig.from_dict(raw)
    ncfg = nemo["config"].DeepseekV41TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    hasher = EngramHasher(cfg, compressed_token_map(tokenizer)[0])
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.2
    hashes = hasher.hash(ids, mask)
    for li, layer in enumerate(cfg.engram_layer_ids):
        mod = nemo["engram"].DeepseekV41Engram(ncfg, layer, backend).eval()
        with torch.no_grad():
            mod.q_weight.normal_(1, 0.3)
            mod.k_weight.normal_(1, 0.3)
            mod.wkv.weight.normal_(0, 0.3)
        x = torch.randn(2, 9, cfg.hc_mult, cfg.hidden_size, generator=g)
        table = mod.embed.weight.detach()
        table = table.to_local() if hasattr(table, "to_local") else table
        with torch.no_grad():
            expected = mod(x, hashes[:, :, li], token_mask=mask)
        got = engram_update(
            x, table[hashes[:, :, li]], mod.wkv.weight, mod.q_weight, mod.k_weight, cfg.rms_norm_eps, mask
        )
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[~mask], x[~mask])


def test_v41_short_chunks_hash_as_long_ones(tokenizer, monkeypatch):
    """``DeepseekV41Model._engram_rows`` of a step of short chunks (a verify step's token and drafts, a prompt's
    last few tokens; token by token in numpy, batched) gives the rows and histories of the per-chunk ``hash`` path,
    image tokens masked included."""
    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.state import SequenceState
    from deepinfer.models.deepseek_v41 import model as v41_model
    from models.tiny_v41 import random_model

    model = random_model(tokenizer, ReferenceOps(), "mixed")
    rng = np.random.default_rng(4)
    h = model.hasher.history_len
    for masked in (False, True):
        lengths = [1, 4, 8, 2, 3]
        histories = [tuple(rng.integers(-1, 60, size=n).tolist()) for n in (0, 1, h, h, 2)]
        ids = [rng.integers(0, model.text.vocab_size, size=n).tolist() for n in lengths]
        mask = torch.from_numpy(rng.random(sum(lengths)) < 0.2) if masked else None
        got = []
        for short in (8, 0):
            monkeypatch.setattr(v41_model, "SHORT_CHUNK", short)
            states = [SequenceState(num_tokens=10, history=x) for x in histories]
            chunks = [SeqChunk(s, 10, n, torch.arange(4)) for s, n in zip(states, lengths)]
            batch = ForwardBatch.build(chunks, ids)
            batch.image_mask = mask
            got.append((model._engram_rows(batch), [s.history for s in states]))
        assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]
