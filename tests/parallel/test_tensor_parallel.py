"""Tensor parallelism of the attention (``deepinfer.parallel.tensor_parallel``): the shards a rank holds and reads,
and the model in real processes (gloo on loopback) against one process.

Groups of ``tp`` ranks run the same sequences, each rank its share of the heads (``wq_b``, ``attn_sink``, ``wo_a``,
``wo_b``), the output summed over the group; the routed experts stay sharded over every rank, each rank of a group
sending its share of the group's tokens. The sums over the group are not one GEMM's, so the logits equal one
process's within fp32 rounding; the ranks of a group hold the same bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.checkpoint import loader
from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.parallel.layout import Layout, layout_of
from deepinfer.parallel.tensor_parallel import Shard, TensorParallel, shard_heads
from parallel import ep_ranks
from parallel.loader_spy import spy_reads
from parallel.test_expert_parallel import run_ranks


def group_outputs(parts: list[dict[str, torch.Tensor]], n: int) -> dict[str, torch.Tensor]:
    """The outputs of each group of ``n`` ranks (its first rank's), after checking its other ranks wrote the same."""
    got: dict[str, torch.Tensor] = {}
    for r, part in enumerate(parts):
        lead = parts[r - r % n]
        assert sorted(part) == sorted(lead) and all(torch.equal(part[k], lead[k]) for k in part), r
        if r % n == 0:
            got.update(part)
    return got


def test_layouts() -> None:
    assert layout_of(4, None, 2) == Layout(4, 2) and layout_of(4, None, 2).dp == 2
    assert layout_of(1, None, 2) == Layout(2, 2) and layout_of(None, None, 2).dp == 1
    assert layout_of(4) == Layout(4, 1) and layout_of(4, 4).dp == 4
    assert [Layout(6, 2).group_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="tp must divide ep"):
        layout_of(3, None, 2)
    with pytest.raises(ValueError, match="dp_attention=4"):
        layout_of(4, 4, 2)
    with pytest.raises(ValueError, match="at least one rank"):
        layout_of(2, None, 0)


def test_rows_and_block_reads() -> None:
    """A group's rows split in consecutive shares (the first ranks one more); a shard of an FP8 weight read by the
    blocks that cover it, then cut."""
    shares = [TensorParallel(None, r, 3).rows(7) for r in range(3)]
    assert shares == [(0, 3), (3, 5), (5, 7)]
    full = torch.arange(40 * 6).view(40, 6)
    sh = Shard(0, 12, 28, 40)
    covered = sh.read(full, 8)  # blocks [8, 32)
    assert covered.shape[0] == 24 and torch.equal(sh.cut(covered, 8), full[12:28])
    assert torch.equal(sh.read(full, None), full[12:28]) and torch.equal(sh.cut(full[12:28], 8), full[12:28])
    assert sh.read_scale(torch.arange(5).view(5, 1), 8).flatten().tolist() == [1, 2, 3]
    assert not sh.aligned(8) and Shard(1, 16, 32, 40).aligned(8) and Shard(0, 32, 40, 40).aligned(16)


def test_a_rank_reads_and_holds_its_heads(tiny_dirs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2: its attention's sharded tensors are read as safetensors slices (never whole), and it holds
    exactly the whole model's rows / columns of its heads and groups (the FP8 weights dequantised by whole blocks)."""
    path = tiny_dirs["base"]
    config = DeepseekV4Config.from_file(path / "config.json")
    full = DeepseekV4Model(config)
    load_checkpoint(full, path, dtype=torch.float32, progress=False)
    whole, _ = spy_reads(monkeypatch, loader)
    part = DeepseekV4Model(config)
    shard_heads(part, TensorParallel(None, 1, 2))
    load_checkpoint(part, path, dtype=torch.float32, progress=False)
    sharded = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".attn.attn_sink")  # (the indexer's wq_b: whole)
    assert not [k for k in whole if k.startswith("layers.") and any(s in k for s in sharded)]
    h, d, g, ol = config.num_attention_heads, config.head_dim, config.o_groups, config.o_lora_rank
    for a, b in zip(part.layers, full.layers):
        assert a.attn.n_heads == h // 2 and a.attn.o_groups == g // 2
        assert torch.equal(a.attn.wq_b.weight, b.attn.wq_b.weight[h // 2 * d :])
        assert torch.equal(a.attn.attn_sink, b.attn.attn_sink[h // 2 :])
        assert torch.equal(a.attn.wo_a.weight, b.attn.wo_a.weight[g // 2 * ol :])
        assert torch.equal(a.attn.wo_b.weight, b.attn.wo_b.weight[:, g // 2 * ol :])
    assert torch.equal(part.mtp[0].attn.wq_b.weight, full.mtp[0].attn.wq_b.weight)  # the drafter keeps every head
    with pytest.raises(ValueError, match="tp must divide"):
        shard_heads(DeepseekV4Model(config), TensorParallel(None, 0, 3))


@pytest.mark.parametrize(("name", "world", "tp", "invariant"), [("base", 2, 2, False), ("v41", 2, 2, True)])
def test_tensor_parallel_ranks_equal_one_process(tiny_dirs: dict, tiny_v41_dir: Path, tmp_path: Path, name: str,
                                                 world: int, tp: int, invariant: bool) -> None:  # fmt: skip
    """Every sequence's logits at every step (chunked prefill, mixed steps) within 1e-4 of one process's; the ranks
    of a tensor-parallel group bit for bit alike (four ranks in two groups: ``test_rank_group.py``)."""
    ckpt = tiny_v41_dir if name == "v41" else tiny_dirs[name]
    one = ep_ranks.drive(ep_ranks.load(ckpt, invariant), list(range(len(ep_ranks.PROMPTS))))
    parts = run_ranks(world, ckpt, tmp_path, invariant, f"tp{tp}")
    got = group_outputs(parts, tp)
    assert sorted(got) == sorted(one)
    for k, want in one.items():
        assert (got[k] - want).abs().max() <= 1e-4, k
    assert any(not torch.equal(got[k], one[k]) for k in one) or invariant  # (the sums' order shows somewhere)


def test_context_parallel_splits_each_chunk_balanced() -> None:
    """Each chunk cut into 2·cp pieces, rank r taking pieces r and 2·cp-1-r (an early and a late one), the first
    rank rotating by chunk; every token on exactly one rank."""
    from deepinfer.parallel.context_parallel import ContextParallel

    offsets = [(0, 16), (16, 17), (17, 18), (18, 30)]
    rows = [ContextParallel(None, r, 2).split(offsets, 30).mine.tolist() for r in range(2)]
    assert sorted(rows[0] + rows[1]) == list(range(30))
    assert rows[0][:8] == [0, 1, 2, 3, 12, 13, 14, 15] and rows[1][:8] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert 16 in rows[1] and 17 in rows[0]  # one-token chunks alternate
    causal = [sum(p - a for p in r for a, b in offsets if a <= p < b) for r in rows]  # keys each rank's queries read
    assert abs(causal[0] - causal[1]) <= 0.1 * sum(causal)


def test_context_parallel_gathers_many_tensors_in_one_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gather_many`` packs each token's rows of tensors of any dtype and shape side by side as bytes, exchanges them
    once, and unpacks them bit for bit, each token's rows where the step has them (two ranks' parts, the other
    rank's played by a stand-in for the exchange)."""
    from deepinfer.parallel import context_parallel
    from deepinfer.parallel.context_parallel import ContextParallel

    cp = ContextParallel(None, 0, 2)
    rows = cp.split([(0, 9)], 9)
    g = torch.Generator().manual_seed(0)
    every = {  # the whole step's tensors: each rank holds its rows
        "kv": torch.randn(9, 3, 4, generator=g).bfloat16(),
        "score": torch.randn(9, 5, generator=g),
        "ids": torch.randint(-(2**31), 2**31 - 1, (9,), generator=g, dtype=torch.int32),
    }
    other = {k: v[rows.every[1]] for k, v in every.items()}
    calls = []

    def all_gather(parts, pad, group=None):  # rank 0's part is ours; rank 1's, packed alike
        calls.append(pad.dtype)
        theirs = torch.cat(
            [v.contiguous().reshape(len(rows.every[1]), -1).view(torch.uint8) for v in other.values()], 1
        )
        parts[0].copy_(pad)
        parts[1].zero_()
        parts[1][: theirs.shape[0]] = theirs

    monkeypatch.setattr(context_parallel.dist, "all_gather", all_gather)
    got = cp.gather_many({k: v[rows.mine] for k, v in every.items()}, rows)
    assert calls == [torch.uint8]  # one exchange
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in every.items())
    # a rank with no token of the step (one token split over two ranks) still takes part in the exchange
    rows = ContextParallel(None, 1, 2).split([(0, 1)], 1)
    assert len(rows.mine) == 0
    other = {k: v[:1] for k, v in every.items()}
    rows.every.reverse()  # (the stand-in's "other rank" is rank 0 here)
    got = ContextParallel(None, 1, 2).gather_many({k: v[:0] for k, v in every.items()}, rows)
    assert all(torch.equal(got[k], v[:1]) for k, v in every.items())


@pytest.mark.parametrize(("name", "world", "cp"), [("base", 4, 2), ("v41", 2, 2)])
def test_context_parallel_ranks_equal_one_process(tiny_dirs: dict, tiny_v41_dir: Path, tmp_path: Path, name: str,
                                                  world: int, cp: int) -> None:  # fmt: skip
    """A step's tokens split over each context-parallel group (each rank its own tokens through every layer, every
    token's state gathered): every sequence's logits at every step (chunked prefill, mixed, decode steps run whole)
    within 1e-4 of one process's with the default ops ("v41": the tiny DeepSeek-V4.1 checkpoint, Engram and every
    CSA2 layer kind); the ranks of a group bit for bit alike. With the batch-invariant ops they are one process's bit
    for bit: ``LLM(cp=2)`` in ``test_rank_group.py`` and ``test_rank_group_v41.py``."""
    ckpt = tiny_v41_dir if name == "v41" else tiny_dirs[name]
    one = ep_ranks.drive(ep_ranks.load(ckpt, False), list(range(len(ep_ranks.PROMPTS))))
    parts = run_ranks(world, ckpt, tmp_path, False, f"cp{cp}")
    steps = [int(p.pop("cp/steps")) for p in parts]
    assert min(steps) >= 2, steps  # the prefill and mixed steps were split
    got = group_outputs(parts, cp)
    assert sorted(got) == sorted(one)
    for k, want in one.items():
        assert (got[k] - want).abs().max() <= 1e-4, k
