"""Expert parallelism (``deepinfer.parallel``): the placement, the sharded loading, and the sharded model in real
processes (a gloo group on loopback, 2 and 4 ranks) against one process.

Each rank holds its slots of every MoE layer and its own sequences (attention data-parallel); every step's tokens
go to their experts' ranks and back (``expert_parallel``). With the batch-invariant ops the logits of every
sequence at every step (chunked prefill, steps mixing prefill and decode) must equal, bit for bit, those of one
process running all sequences with every expert; with the default ops, within fp32 rounding."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.checkpoint import loader
from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.parallel.expert_parallel import ExpertParallel, shard
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.quant import native
from deepinfer.quant.native import EXPERT_WEIGHTS, REFS_ATTR, expert_order, order_experts, stored_experts
from parallel import ep_ranks
from parallel.loader_spy import spy_reads

ROOT = Path(__file__).resolve().parents[2]


def test_even_placement_and_routes() -> None:
    p = ExpertPlacement.even(6, 4)
    assert p.slots == ((0, 1), (2, 3), (4,), (5,))
    idx = torch.tensor([[5, 0], [3, 4]])
    rank, slot = p.route(idx, 0)
    assert rank.tolist() == [3, 0, 1, 2] and slot.tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="no slot"):
        ExpertPlacement(4, ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement(2, ((0, 1), (2,)))


def test_redundant_copies_split_a_hot_experts_tokens() -> None:
    """Expert 1 has a copy on each of two ranks: its tokens alternate between them (by token and source rank)."""
    p = ExpertPlacement(3, ((0, 1), (1, 2)))
    assert p.copies(1) == [(0, 1), (1, 0)]
    rank, slot = p.route(torch.tensor([[1], [1], [1], [2]]), 1)
    assert rank.tolist() == [1, 0, 1, 1] and slot.tolist() == [0, 1, 0, 1]


class _Group:
    """Stands in for a group's exchange where no exchange runs (loading only)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def test_a_shard_reads_only_its_experts(tiny_dirs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's model with sharded MoE layers reads its experts' tensors and no other routed expert's, and its
    slots hold what the whole model holds for those experts."""
    path = tiny_dirs["base"]
    config = DeepseekV4Config.from_file(path / "config.json")
    full = DeepseekV4Model(config)
    load_checkpoint(full, path, dtype=torch.float32, progress=False)
    placement = ExpertPlacement(config.n_routed_experts, ((0, 3, 3), tuple(range(1, config.n_routed_experts))))
    whole, sliced = spy_reads(monkeypatch, loader)
    part = DeepseekV4Model(config)
    for layer in part.layers:
        shard(layer.ffn, ExpertParallel(placement, _Group(0, 2)))
    load_checkpoint(part, path, dtype=torch.float32, progress=False)
    read = whole + sliced
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k and k.startswith("layers.")}
    assert experts == {0, 3}
    for a, b in zip(part.layers, full.layers):
        assert a.ffn.w1.shape[0] == 3
        assert torch.equal(a.ffn.w1, b.ffn.w1[[0, 3, 3]]) and torch.equal(a.ffn.w2, b.ffn.w2[[0, 3, 3]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, ckpt: Path, out: Path, invariant: bool, mode: str = "plain", timeout: float = 600
              ) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """``ep_ranks.main`` in ``world`` processes; what each wrote (``timeout``: ranks out of step wait forever)."""
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("libs", ".", "tests"))}
    script = str(ROOT / "tests" / "parallel" / "ep_ranks.py")
    flags = [port, str(ckpt), str(out), "1" if invariant else "0", mode]
    procs = [
        subprocess.Popen([sys.executable, script, str(r), str(world), *flags], env=env, stderr=subprocess.PIPE)
        for r in range(world)
    ]
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode:
            errs.append(err.decode()[-3000:])
    assert not errs, errs[0]
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(world)]


@pytest.mark.parametrize(("name", "world", "invariant"), [("odd", 4, True), ("base", 2, False), ("v41", 2, True)])
def test_the_sharded_model_equals_one_process(tiny_dirs: dict, tiny_v41_dir: Path, tmp_path: Path, name: str,
                                              world: int, invariant: bool) -> None:  # fmt: skip
    """("odd": top-3 of 6 experts, so the order a token sums its experts' outputs in shows in the bits; "v41": the
    tiny DeepSeek-V4.1 checkpoint, Engram and DSpark stages included.)"""
    ckpt = tiny_v41_dir if name == "v41" else tiny_dirs[name]
    one = ep_ranks.drive(ep_ranks.load(ckpt, invariant), list(range(len(ep_ranks.PROMPTS))))
    got: dict[str, torch.Tensor] = {}
    for part in run_ranks(world, ckpt, tmp_path, invariant):
        got.update(part)
    assert sorted(got) == sorted(one)
    steps = {k.split("/")[1] for k in one}
    assert len(steps) == ep_ranks.STEPS  # every step ran (prefill chunks, mixed, decode)
    for k, want in one.items():
        if invariant:
            assert torch.equal(got[k], want), k
        else:
            assert (got[k] - want).abs().max() <= 1e-4, k


@pytest.mark.parametrize(("name", "world", "invariant"), [("odd", 2, True), ("base", 2, False), ("v41", 2, True)])
def test_fixed_buffers_give_the_logits_of_one_process(tiny_dirs: dict, tiny_v41_dir: Path, tmp_path: Path,
                                                      name: str, world: int, invariant: bool) -> None:  # fmt: skip
    """``DEEPINFER_EP_FIXED_BUFFER_TOKENS`` = 14 (``FixedBuffers``): the two prefill steps (27 and 28 tokens, then 15
    and 13: one rank alone would take the fixed buffers there, the ranks agree on counts) exchange row counts, the
    later ones (at most 7 tokens a rank) blocks of 14 tokens' rows; the logits are one process's, bit for bit with
    the batch-invariant ops."""
    ckpt = tiny_v41_dir if name == "v41" else tiny_dirs[name]
    one = ep_ranks.drive(ep_ranks.load(ckpt, invariant), list(range(len(ep_ranks.PROMPTS))))
    got: dict[str, torch.Tensor] = {}
    parts = run_ranks(world, ckpt, tmp_path, invariant, "fixed14")
    for part in parts:
        got.update(part)
    assert [int(p["fixed/steps"]) for p in parts] == [ep_ranks.STEPS - 2] * world
    del got["fixed/steps"]
    assert sorted(got) == sorted(one)
    for k, want in one.items():
        if invariant:
            assert torch.equal(got[k], want), k
        else:
            assert (got[k] - want).abs().max() <= 1e-4, k


@pytest.mark.parametrize("name", ["base", "v41"])
def test_decode_graphs_replay_over_ranks(tiny_dirs: dict, tiny_v41_dir: Path, tmp_path: Path, name: str) -> None:
    """Decode graphs on 3 ranks with fixed buffers of 4 tokens (``ep_ranks.HostReplays`` stands in for CUDA graphs:
    a capture runs its segments twice, a replay leaves no Python count). Every rank captures bucket 4 in a warm-up
    run alike; then ranks 0 and 1 (3 sequences each, 4 rows with the padding) replay it in the steps taken in the
    fixed form, while rank 2 (2 sequences, bucket 2, never captured) runs those steps eagerly in the same form: it
    may not capture on first use (``ReplayGate.capturing``), which would run exchanges that no other rank joins.
    The one-process logits within rounding (a padded bucket). V4 and V4.1 (Engram, DSpark stages)."""
    ckpt = tiny_v41_dir if name == "v41" else tiny_dirs[name]
    one = ep_ranks.drive(ep_ranks.load(ckpt, False), list(range(len(ep_ranks.PROMPTS))))
    parts = run_ranks(3, ckpt, tmp_path, False, "graphs4", timeout=300)  # (a few seconds in step)
    # (replays, captures) per rank: the warm-up's step replays its capture, then steps 3-5 on ranks 0 and 1
    assert [p.pop("graphs").tolist() for p in parts] == [[4, 1], [4, 1], [1, 1]]
    for p in parts:
        del p["fixed/steps"]
    got = {k: v for p in parts for k, v in p.items()}
    assert sorted(got) == sorted(one)
    for k, want in one.items():
        assert (got[k] - want).abs().max() <= 1e-4, k


def test_the_replay_gate() -> None:
    """``ReplayGate``: a sharded model's bucket replays only in a step decided for the fixed buffers, its padded
    rows within them; it is captured only while every rank captures (the warm-up, whose forms are agreed in the
    forward); with no fixed buffers (the counts form) never. ``SegmentGraphs.bucket`` asks it (a drafter's graphs,
    ``collective`` False, do not)."""
    from deepinfer.parallel.expert_parallel import FixedBuffers, ReplayGate
    from deepinfer.runtime.decode_graphs import SegmentGraphs

    fixed = FixedBuffers(8)
    gate = ReplayGate(fixed)
    assert not ReplayGate(None).replays(1)
    assert not gate.replays(4)  # (not decided: forms agreed in the forward, which a replay skips)
    fixed.decided = True
    assert gate.replays(8) and not gate.replays(9)
    fixed.decided = False
    assert not gate.replays(1)
    fixed.decided, gate.capturing = None, True
    assert gate.replays(8) and not gate.replays(9)

    class Graphs(SegmentGraphs):
        def _size(self, batch: object) -> int:
            return 4

        def _capture(self, size: int, device: torch.device, extra: tuple = (), before: object = None) -> object:
            self.captures += 1
            return "bucket"

    model = torch.nn.Module()
    model.ops, model.replay_gate = object(), gate
    graphs, drafter = Graphs(model, max_batch=8), Graphs(model, max_batch=8)
    drafter.collective = False
    batch = type("Batch", (), {"device": torch.device("cpu")})()
    gate.capturing, fixed.decided = False, True
    assert graphs.bucket(batch) is None and graphs.captures == 0  # not captured in a warm-up: eager
    assert drafter.bucket(batch) == "bucket"  # (no exchange in a drafter's pass: captured on first use)
    gate.capturing, fixed.decided = True, None
    assert graphs.bucket(batch) == "bucket" and graphs.captures == 1
    gate.capturing, fixed.decided = False, True
    assert graphs.bucket(batch) == "bucket"  # replayed in a fixed step
    fixed.decided = False
    assert graphs.bucket(batch) is None  # a step in the counts form: eager
    fixed.decided, fixed.tokens = True, 3
    assert graphs.bucket(batch) is None and drafter.bucket(batch) == "bucket"  # 4 rows overrun 3 tokens
    fixed.tokens, model.decode_graphs = 8, graphs
    assert graphs.bucket(batch) == "bucket"
    gate.give_up(model)  # (EPLB moved the experts: the graphs hold the old tensors)
    assert not graphs.buckets and not gate.replays(1) and graphs.bucket(batch) is None


def test_ranks_given_other_fixed_buffers_are_refused(tiny_dirs: dict, tmp_path: Path) -> None:
    """Ranks given different ``DEEPINFER_EP_FIXED_BUFFER_TOKENS`` would wait for each other at the first step: every
    rank refuses at start (``FixedBuffers.check``), naming the values."""
    for part in run_ranks(3, tiny_dirs["base"], tmp_path, False, "check"):
        msg = bytes(part["refused"].tolist()).decode()
        assert "DEEPINFER_EP_FIXED_BUFFER_TOKENS from 4 to 6" in msg


def test_a_v41_shard_reads_only_its_experts(tiny_v41_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The V4.1 loader, a rank of two: the trunk's routed experts it reads are its own (the DSpark stages keep all)."""
    from deepinfer.checkpoint import loader_v41

    read: list[str] = []
    real = loader_v41._Reader.get
    monkeypatch.setattr(
        loader_v41._Reader, "get", lambda self, key, part=None: read.append(key) or real(self, key, part)
    )
    n = ep_ranks.n_experts(tiny_v41_dir)
    placement = ExpertPlacement.even(n, 2)
    model = ep_ranks.load(tiny_v41_dir, True, ExpertParallel(placement, _Group(1, 2)))
    trunk = {int(k.split(".experts.")[1].split(".")[0]) for k in read if k.startswith("layers.") and ".experts." in k}
    assert trunk == set(placement.slots[1])
    assert all(layer.ffn.w1.shape[0] == len(placement.slots[1]) for layer in model.layers)


@pytest.mark.parametrize("mode", ["eplb", "eplb-arranged"])
def test_experts_move_between_steps_and_the_logits_stay(tiny_dirs: dict, tmp_path: Path, mode: str) -> None:
    """EPLB on 3 ranks (``ep_ranks.rebalance_after``): after step 2 each layer's loads (summed over the ranks) give
    a placement with a redundant slot per rank, and the experts move (``move_experts``) through the exchange. Each
    rank then holds the whole model's weights of its new experts, the busiest expert has a second copy, and every
    step's logits stay the single-process ones, bit for bit. ``eplb-arranged``: the experts kept in MXFP4 by an op
    set that derives data from them for its kernels (``ep_ranks.ArrangingOps``, as the NVIDIA one does): after the
    move their codes are rearranged as the single process's and the derived data is that of the rows now held; its
    ranks hold EPLB's slot count from the start (``ExpertPlacement.even``'s ``slots``), so every weight, routing table
    and derived tensor stays where it was (captured graphs hold them); ``eplb`` starts with one slot per expert, and
    the move changes its tensors' shapes."""
    ckpt, arranged = tiny_dirs["odd"], mode == "eplb-arranged"
    full = ep_ranks.load(ckpt, True, arranged=arranged)
    assert not arranged or all(ep_ranks.arranged_now(layer.ffn) for layer in full.layers)
    one = ep_ranks.drive(full, list(range(len(ep_ranks.PROMPTS))))
    parts = run_ranks(3, ckpt, tmp_path, True, mode)
    got = {k: v for part in parts for k, v in part.items() if k.split("/")[0].isdigit()}
    assert sorted(got) == sorted(one) and all(torch.equal(got[k], v) for k, v in one.items())
    for i, layer in enumerate(full.layers):
        load = parts[0][f"load/{i}"]
        held = [p[f"held/{i}"].tolist() for p in parts]
        assert len([x for h in held for x in h]) > full.config.n_routed_experts  # copies were added
        assert sum(h.count(int(load.argmax())) for h in held) >= 2
        for p, h in zip(parts, held):
            assert torch.equal(p[f"w1/{i}"], layer.ffn.w1[h]) and torch.equal(p[f"w2/{i}"], layer.ffn.w2[h])
            assert bool(p[f"arranged/{i}"]) == arranged
            assert bool(p[f"kept/{i}"]) == arranged


def test_stored_experts_undoes_the_arrangement() -> None:
    """``stored_experts`` puts rearranged MXFP4 codes back in the stored order, bit for bit, drops W4A8 row
    references, and leaves a module in the stored order as it is."""
    torch.manual_seed(0)
    m = torch.nn.Module()
    for name in EXPERT_WEIGHTS:
        w, s = native.quantize_experts(torch.randn(4, 16, 64))
        setattr(m, name, torch.nn.Parameter(w, requires_grad=False))
        setattr(m, f"{name}_scale", s)
    stored = [getattr(m, w).clone() for w in EXPERT_WEIGHTS]
    assert order_experts(m, "rotate") == 1 and expert_order(m) == "rotate"
    assert any(not torch.equal(getattr(m, w), t) for w, t in zip(EXPERT_WEIGHTS, stored))
    setattr(m, REFS_ATTR, (torch.zeros(1),) * 3)
    assert stored_experts(m) == 1 and expert_order(m) == "plain" and getattr(m, REFS_ATTR) is None
    assert all(torch.equal(getattr(m, w), t) for w, t in zip(EXPERT_WEIGHTS, stored))
    assert stored_experts(m) == 0


def test_the_load_counts_stay_in_one_tensor() -> None:
    """EPLB's counts (``ExpertParallel.take_load``): each call returns the tokens routed to each expert since the
    last one and zeroes the same tensor, which a captured step keeps counting into."""
    ep = ExpertParallel(ExpertPlacement.even(4, 2), _Group(0, 2))
    assert ep.take_load().tolist() == [0, 0, 0, 0]
    ep._count(torch.tensor([[0, 2], [2, 3]]))
    counts = ep.load
    assert ep.take_load().tolist() == [1, 0, 2, 1] and ep.load is counts and counts.tolist() == [0, 0, 0, 0]
    ep._count(torch.tensor([[1, 2]]))
    assert ep.take_load().tolist() == [0, 1, 1, 0] and ep.load is counts
