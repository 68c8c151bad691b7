"""Weights kept in the checkpoint's formats (``deepinfer.quant.native``): FP8 dense linears and MXFP4 experts stay as
stored through both loaders, decode to exactly what load-time dequantisation gives, and a model run on them with the
reference ops (which decode per call) gives bit-identical logits to one loaded dequantised. A checkpoint that stores
a weight in another format (bf16, FP8 experts) still loads into a prepared model: that weight is decoded instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.backends.reference import ReferenceOps
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.models import build_model, parse_config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.quant.formats import dequantize_fp8_blocks, dequantize_mxfp4, quantize_fp8_blocks
from deepinfer.quant.native import (
    dequantize_experts,
    expert_modules,
    expert_order,
    fp8_linears,
    order_experts,
    prepare_native,
    quantize_experts,
    stored_experts,
)


class NativeReferenceOps(ReferenceOps):
    native_weights = True


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("native_v4") / "m", seed=3)


def _config(path: Path):  # noqa: ANN202
    import json

    return parse_config(json.loads((path / "config.json").read_text()))


def _build(path: Path, ops: ReferenceOps):  # noqa: ANN202
    return build_model(path, _config(path), ops, torch.float32, torch.device("cpu"), quant_sim=False)


def _logits(model, config, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    chunk = SeqChunk(SequenceState(), 0, len(ids), torch.arange(8))
    return model.logits(model(ForwardBatch.build([chunk], [ids]), PagedKVCache(config, 8, 16)))


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_native_load_keeps_stored_formats_and_logits(arch: str, tiny_v4: Path, tiny_v41_dir: Path) -> None:
    path = tiny_v4 if arch == "v4" else tiny_v41_dir
    config = _config(path)
    plain, native = _build(path, ReferenceOps()), _build(path, NativeReferenceOps())
    linears, experts = dict(fp8_linears(native)), dict(expert_modules(native))
    assert linears and experts
    for name, m in linears.items():
        assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float32, name
        want = plain.get_submodule(name).weight
        assert torch.equal(dequantize_fp8_blocks(m.weight, m.scale, dtype=torch.float32), want), name
    for name, m in experts.items():
        for w in ("w1", "w2", "w3"):
            packed, scales = getattr(m, w), getattr(m, f"{w}_scale")
            assert packed.dtype == torch.int8 and scales.dtype == torch.uint8, name
            want = getattr(plain.get_submodule(name), w)
            assert torch.equal(dequantize_experts(packed, scales, torch.float32), want), f"{name}.{w}"
    # the grouped wo_a stays FP8 (ops.fp8_grouped_linear); the V4.1 Engram projection is read directly: never kept
    assert any(n.endswith("wo_a") for n in linears)
    assert not any(n.endswith("engram.wkv") for n in linears)
    keys = [f"{n}.{w}" for n in linears for w in ("weight", "scale")]
    keys += [f"{n}.{w}{s}" for n in experts for w in ("w1", "w2", "w3") for s in ("", "_scale")]
    size = {m: {k: t.numel() * t.element_size() for k, t in m.state_dict().items()} for m in (native, plain)}
    assert sum(size[native][k] for k in keys) < 0.3 * sum(size[plain].get(k, 0) for k in keys)  # 4 B vs ≤ 1.03 B
    ids = list(range(100, 131))
    assert torch.equal(_logits(native, config, ids), _logits(plain, config, ids))


def test_checkpoint_in_other_formats_loads_into_a_prepared_model(tiny_v4: Path, tmp_path: Path) -> None:
    """bf16-stored dense weights and routed experts (a conversion of the checkpoint) are decoded, not kept."""
    stored = load_file(str(tiny_v4 / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for k, t in stored.items():
        if k.endswith(".scale"):
            continue
        s = stored.get(k[: -len("weight")] + "scale") if k.endswith(".weight") else None
        if s is None:
            out[k] = t
        elif t.dtype == torch.float8_e4m3fn:
            out[k] = dequantize_fp8_blocks(t, s, dtype=torch.bfloat16)
        else:
            out[k] = dequantize_mxfp4(t, s, dtype=torch.bfloat16)
    conv = tmp_path / "bf16"
    conv.mkdir()
    for f in tiny_v4.iterdir():
        if f.suffix != ".safetensors":
            (conv / f.name).write_bytes(f.read_bytes())
    save_file(out, str(conv / "model.safetensors"))
    config = _config(conv)
    native, plain = _build(conv, NativeReferenceOps()), _build(tiny_v4, ReferenceOps())
    assert not any(m.weight.dtype == torch.float8_e4m3fn for _, m in fp8_linears(native))
    assert all(m.w1.dtype == torch.float32 and m.w1_scale is None for _, m in expert_modules(native))
    ids = list(range(7, 40))
    assert torch.equal(_logits(native, config, ids), _logits(plain, config, ids))


def test_prepare_native_quantizes_in_place() -> None:
    """``quantize=True`` (random benchmark models): the stored values are the weights' FP8 / MXFP4 encodings."""
    from deepinfer.checkpoint.tiny import TINY_V4
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

    model = DeepseekV4Model(DeepseekV4Config.from_dict(dict(TINY_V4)))
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.05 if p.is_floating_point() else p.data
    before = {n: m.weight.clone() for n, m in fp8_linears(model)}
    w1 = {n: m.w1.clone() for n, m in expert_modules(model)}
    prepare_native(model, (128, 128), quantize=True)
    for n, m in fp8_linears(model):
        q, s = quantize_fp8_blocks(before[n], (128, 128))
        assert torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(m.scale, s.float())
    for n, m in expert_modules(model):
        q, s = quantize_experts(w1[n])
        assert torch.equal(m.w1, q) and torch.equal(m.w1_scale, s)


def test_v41_on_the_nvidia_kernels_with_native_weights(tiny_v41_dir: Path) -> None:
    """DeepSeek-V4.1 (32×32 FP8 blocks, MXFP4 experts) through NvidiaOps' FP8 / MXFP4 kernels (the interpreter on
    CPU) against the reference ops on the same stored weights: a prompt chunk, then a decode step."""
    pytest.importorskip("triton")
    import os

    from deepinfer.backends.nvidia import NvidiaOps

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through the interpreter; on a GPU bench/engine/sweep_v41.py runs the kernels")
    config = _config(tiny_v41_dir)
    model = _build(tiny_v41_dir, NativeReferenceOps())

    def run(ops: ReferenceOps) -> torch.Tensor:
        model.ops = ops
        st, table = SequenceState(), torch.arange(8)
        cache = PagedKVCache(config, 8, 16)
        first = model.logits(model(ForwardBatch.build([SeqChunk(st, 0, 11, table)], [list(range(50, 61))]), cache))
        nxt = model.logits(model(ForwardBatch.build([SeqChunk(st, 11, 1, table)], [[77]]), cache))
        return torch.cat([first, nxt])

    op_sets = (ReferenceOps(), NvidiaOps(native_weights=True, cuda_graphs=False))
    out = [run(ops) for ops in op_sets]
    assert (out[0] - out[1]).abs().max().item() < 1e-4
    # the experts' codes rearranged into the shift and the rotate order (the latter what NvidiaOps.prepare_weights does
    # on a GPU): the reference ops read both, NvidiaOps' kernels the rotate order, to the same logits, bit for bit
    op_sets[1].prepare_weights(model)  # CPU tensors: left as they are
    assert all(expert_order(m) == "plain" for _, m in expert_modules(model))
    w1 = {n: m.w1.clone() for n, m in expert_modules(model)}
    for order in ("shift", "rotate"):
        assert order_experts(model, order) == len(w1) > 0
        assert all(expert_order(m) == order and not torch.equal(m.w1, w1[n]) for n, m in expert_modules(model))
        assert order_experts(model, order) == 0  # once
        for ops, before in zip(op_sets, out, strict=True):
            if order == "rotate" or ops is op_sets[0]:  # (the interpreter once, in the order a GPU runs: it is slow)
                assert torch.equal(run(ops), before)
        assert stored_experts(model) == len(w1)  # back to the stored order
        assert all(torch.equal(m.w1, w1[n]) for n, m in expert_modules(model))


def test_order_experts_keeps_experts_whose_scales_do_not_fit() -> None:
    """An expert module with a scale outside ``nibble_order.SCALE_RANGE`` (2^1 and up) stays in the plain order."""
    from deepinfer.checkpoint.tiny import TINY_V4
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

    model = DeepseekV4Model(DeepseekV4Config.from_dict(dict(TINY_V4)))
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.05 if p.is_floating_point() else p.data
    prepare_native(model, (128, 128), quantize=True)
    mods = [m for _, m in expert_modules(model)]
    mods[0].w2_scale[0, 0, 0] = 129
    before = mods[0].w1.clone()
    assert order_experts(model) == len(mods) - 1
    assert expert_order(mods[0]) == "plain" and torch.equal(mods[0].w1, before)
