"""Resume points as bytes (``models/deepseek_v4/resume_format.py``): a sequence's state encoded, decoded into another
cache at other page ids, continues exactly as the original (bit-identical logits)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.models.deepseek_v4 import resume_format
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState, StateSnapshot

PS = 16


@pytest.fixture(scope="module", params=["base", "odd"])
def model(request: pytest.FixtureRequest, tiny_dirs: dict) -> DeepseekV4Model:
    path = tiny_dirs[request.param]
    m = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"))
    load_checkpoint(m, path, dtype=torch.float32, progress=False)
    return m


def step(model, cache, state, table, tokens) -> torch.Tensor:
    batch = ForwardBatch.build([SeqChunk(state, state.num_tokens, len(tokens), table)], [tokens])
    return model.logits(model(batch, cache))


@pytest.mark.parametrize("position", [37, 48])  # a partial last page, and a page boundary
def test_a_resume_point_survives_bytes_and_other_pages(model, position):
    c = model.config
    ids = torch.randint(2, c.vocab_size, (position + 5,), generator=torch.Generator().manual_seed(position)).tolist()
    a = PagedKVCache(c, 8, PS)
    table_a = torch.tensor([6, 2, 7, 1])
    st = SequenceState()
    step(model, a, st, table_a, ids[:position])
    full = position // PS
    data = resume_format.encode(StateSnapshot.take(st, a, table_a), a.read_pages(table_a[:full]))
    assert resume_format.metadata(data)["position"] == str(position)
    ref = [step(model, a, st, table_a, [t]) for t in ids[position:]]

    snap, pages = resume_format.decode(data)
    b = PagedKVCache(c, 8, PS)
    table_b = torch.tensor([3, 0, 5, 4])
    b.write_pages(table_b[:full], pages)
    st_b = snap.restore(b, table_b, "cpu")
    got = [step(model, b, st_b, table_b, [t]) for t in ids[position:]]
    for x, y in zip(ref, got):
        assert torch.equal(x, y)


def test_bad_bytes_are_refused():
    with pytest.raises(ValueError, match="truncated"):
        resume_format.decode(b"\x01")
    with pytest.raises(ValueError, match="layout"):
        from safetensors.torch import save

        resume_format.decode(save({"x": torch.zeros(1)}, metadata={"layout": "other"}))
