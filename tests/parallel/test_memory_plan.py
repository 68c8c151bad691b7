"""``deepinfer plan`` (``parallel/memory_plan.py``) on the released models' configs (``docs/configs``), and its bytes
against a model the loader actually fills."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.cli import main
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.parallel.memory_plan import GIB, HEADS, plan, render
from deepinfer.quant.native import prepare_native

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "docs" / "configs"


def test_v4_flash_fits_two_h200s_and_not_one(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", str(CONFIGS / "deepseek-v4-flash"), "--gpus", "2", "--gpu-mem", "141GB"]) == 0
    out = capsys.readouterr().out
    assert "up to 128 of 256 routed experts" in out and "batch    1: 1,048,576 tokens" in out
    p = plan(CONFIGS / "deepseek-v4-flash", 2, 141 * 10**9)
    assert 140 * GIB < sum(p.weights.values()) < 150 * GIB  # the released checkpoint: about 145 GiB
    assert p.rank_gpu["routed experts"] * 2 == p.weights["routed experts"]
    assert p.free > 30 * GIB and p.context(64) > 100_000
    assert main(["plan", "--model", str(CONFIGS / "deepseek-v4-flash"), "--gpus", "1", "--gpu-mem", "141GB"]) == 2
    assert "does not fit 1 GPU(s)" in capsys.readouterr().err


def test_eplb_s_extra_slots_are_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """With EPLB on, each rank holds ``DEEPINFER_EPLB_EXTRA_SLOTS`` more experts per layer from the start."""
    monkeypatch.setenv("DEEPINFER_EPLB_INTERVAL_STEPS", "100")
    monkeypatch.setenv("DEEPINFER_EPLB_EXTRA_SLOTS", "2")
    p = plan(CONFIGS / "deepseek-v4-flash", 2, 141 * 10**9)
    assert p.experts_per_rank == 130 and p.rank_gpu["routed experts"] == p.weights["routed experts"] * 130 // 256


def test_v41_flash_needs_its_engram_tables_in_host_memory(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", str(CONFIGS / "deepseek-v41-flash"), "--gpus", "4", "--gpu-mem", "141GB"]
    assert main([*args, "--engram", "device"]) == 2
    assert "DEEPINFER_ENGRAM_TABLES=host" in capsys.readouterr().err
    assert main([*args, "--engram", "host"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host memory \(Engram tables, once per host\)\s+366\.\d+ GiB", out)


def test_v4_pro_plans(capsys: pytest.CaptureFixture) -> None:
    """V4-Pro: its drafter and dense part on every rank leave eight H200s short; sixteen hold it."""
    args = ["plan", "--model", str(CONFIGS / "deepseek-v4-pro"), "--gpu-mem", "141GB"]
    assert main([*args, "--gpus", "8"]) == 2
    assert main([*args, "--gpus", "16"]) == 0
    assert "up to 24 of 384 routed experts" in capsys.readouterr().out
    assert main([*args, "--gpus", "8", "--tp", "2"]) == 2  # half the heads a rank: still short
    assert main([*args, "--gpus", "8", "--tp", "8"]) == 0  # an eighth of the heads: it fits, with little KV room
    assert "1 group of 8 ranks" in capsys.readouterr().out
    full, split = (plan(CONFIGS / "deepseek-v4-pro", 16, 141 * 10**9, tp=t) for t in (1, 8))
    assert split.rank_gpu[HEADS] * 8 == full.rank_gpu[HEADS] > 16 * GIB
    assert main([*args, "--gpus", "8", "--tp", "3"]) == 2


def test_bad_sizes_are_refused(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", str(CONFIGS / "deepseek-v4-flash"), "--gpus", "2"]
    assert main([*args, "--gpu-mem", "lots"]) == 2
    assert "cannot read a memory size from 'lots'" in capsys.readouterr().err
    assert main([*args[:-1], "0", "--gpu-mem", "141GB"]) == 2


def test_the_plans_bytes_are_the_loaded_models(tiny_dirs: dict) -> None:
    """On a tiny checkpoint: the weights the plan counts are those of the model the loader fills in the stored
    formats (bf16 elsewhere, fp32 where the loader keeps it), and its KV bytes per token the paged cache's."""
    path = tiny_dirs["base"]
    config = DeepseekV4Config.from_file(path / "config.json")
    net = DeepseekV4Model(config)
    prepare_native(net, tuple(config.weight_block_size), quantize=False)
    load_checkpoint(net, path, dtype=torch.bfloat16, progress=False)
    loaded = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()] if t is not None)
    p = plan(path, 1, 10**12, reserve=0)
    assert sum(p.weights.values()) == loaded
    cache = PagedKVCache(config, 1, 64, torch.bfloat16, "meta")
    assert p.token_bytes == cache.bytes_per_page() // 64


def test_the_docs_show_the_plan_it_prints() -> None:
    """docs/parallelism.md quotes ``deepinfer plan`` for V4-Flash on two H200s: every quoted line is printed."""
    doc = (ROOT / "docs" / "parallelism.md").read_text()
    quoted = doc.split("<!-- plan: deepseek-v4-flash 2 141GB -->")[1].split("```")[1].strip("\n").splitlines()
    printed = render(plan(CONFIGS / "deepseek-v4-flash", 2, 141 * 10**9)).splitlines()
    assert quoted and quoted == printed


@pytest.mark.parametrize("ranks", [2, 8])
def test_the_docs_show_the_cost_model_it_computes(ranks: int) -> None:
    from deepinfer.parallel.cost_model import table

    doc = (ROOT / "docs" / "parallelism.md").read_text()
    quoted = doc.split(f"<!-- cost: deepseek-v4-flash {ranks} -->")[1].strip().split("\n\n")[0]
    assert quoted == table(CONFIGS / "deepseek-v4-flash", ranks)


def test_engram_tables_go_to_host_memory(tiny_v41_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DEEPINFER_ENGRAM_TABLES=host``: the V4.1 build keeps the tables out of the model's move and places them in
    host memory (``place_engram_tables``); the model computes what it computes with them on the device."""
    import json

    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.engine.models import family_of, parse_config
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model

    config = parse_config(json.loads((tiny_v41_dir / "config.json").read_text()))
    placed = []
    real = DeepseekV41Model.place_engram_tables
    monkeypatch.setattr(
        DeepseekV41Model, "place_engram_tables", lambda self, d, **kw: placed.append(d) or real(self, d, **kw)
    )
    nets = {}
    for where in ("device", "host"):
        monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", where)
        nets[where] = family_of(config).build(tiny_v41_dir, config, ReferenceOps(), torch.float32, "cpu", False)
    assert placed == ["cpu"]
    for a, b in zip(nets["device"].layers, nets["host"].layers):
        if a.engram is not None:
            assert b.engram.embed.weight.numel() > 0 and torch.equal(a.engram.embed.weight, b.engram.embed.weight)
