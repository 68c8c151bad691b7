"""``DEEPINFER_W8A8``: the FP8 linears take the official FP8 activations (1×128 blocks, power-of-two scales) and
nothing else changes; the worker's fingerprint tells its KV state apart from a worker without them."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.backends.reference import ReferenceOps
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.factory import build_worker
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import Linear, join_rows, rows_forward, set_w8a8, uses_w8a8
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.quant.formats import quantize_fp8_blocks

OPS = ReferenceOps()


def _fp8(k: int, n: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, fp8=True)
    w, s = quantize_fp8_blocks(torch.randn(n, k, generator=g) * k**-0.5, (128, 128))
    lin.weight.data, lin.scale = w, s
    return lin


def test_a_w8a8_linear_rounds_its_input_and_a_bf16_one_does_not():
    lin, plain = _fp8(256, 128, 1), Linear(256, 64)
    plain.weight.data = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)) * 5
    before, before_plain = lin(x, OPS), plain(x, OPS)
    net = torch.nn.ModuleList([lin, plain])
    assert not uses_w8a8(net)
    set_w8a8(net, True)
    assert uses_w8a8(net) and lin.act_fp8 and not plain.act_fp8
    want = OPS.fp8_linear(OPS.act_quant_sim(x, 128), lin.weight, lin.scale, False)
    torch.testing.assert_close(lin(x, OPS), want, rtol=0, atol=0)
    assert not torch.equal(lin(x, OPS), before)  # the rounding bites
    assert torch.equal(plain(x, OPS), before_plain)  # weights stored in bf16 keep their input
    set_w8a8(net, False)
    assert torch.equal(lin(x, OPS), before)


def test_joined_projections_keep_one_gemm_with_w8a8():
    lins = [_fp8(256, 128, 4), _fp8(256, 128, 5)]
    set_w8a8(torch.nn.ModuleList(lins), True)
    assert join_rows(lins)
    calls = []
    ops = ReferenceOps()
    ops.fp8_linear = lambda *a: calls.append(a[3]) or ReferenceOps.fp8_linear(ops, *a)
    x = torch.randn(2, 256) * 3
    got = rows_forward(x, lins, ops)
    assert calls == [True]  # one GEMM, with the activation rounding
    for a, lin in zip(got, lins):
        torch.testing.assert_close(a, lin(x, OPS), rtol=0, atol=0)


def _logits(parts, ids: list[int]) -> torch.Tensor:
    batch = ForwardBatch.build([SeqChunk(SequenceState(), 0, len(ids), torch.arange(8))], [ids])
    return parts.model.logits(parts.model(batch, parts.runner.cache))


def test_the_variable_reaches_the_model_and_its_fingerprint(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=3, overrides={"hidden_size": 128, "q_lora_rank": 128})  # 128-wide K
    ids = list(range(5, 45))
    with envs.override(DEEPINFER_W8A8=False):
        base = build_worker(path, dtype="float32", accelerator="cpu", num_pages=16)
    with envs.override(DEEPINFER_W8A8=True):
        w8 = build_worker(path, dtype="float32", accelerator="cpu", num_pages=16)
    assert not uses_w8a8(base.model) and uses_w8a8(w8.model)
    fp8 = [m for m in w8.model.modules() if isinstance(m, Linear) and m.fp8]
    assert fp8 and all(m.act_fp8 for m in fp8)
    assert not any(getattr(m, "quant_sim", False) for m in w8.model.modules())  # the cache keeps its precision
    assert base.fingerprint != w8.fingerprint
    a, b = _logits(base, ids), _logits(w8, ids)
    assert not torch.equal(a, b)

    def rounded(mod, args):  # the same rounding, applied from outside: each FP8 linear's input, 128-wide K only
        x = args[0]
        return (OPS.act_quant_sim(x, 128) if x.shape[-1] % 128 == 0 else x, *args[1:])

    hooks = [m.register_forward_pre_hook(rounded) for m in base.model.modules() if isinstance(m, Linear) and m.fp8]
    try:
        assert torch.equal(_logits(base, ids), b)  # the same model, only the linears' inputs rounded
    finally:
        for h in hooks:
            h.remove()
