"""Projections of one input read by one GEMM (``layers.join_rows``, ``rows_forward``, ``rows_fp32``): the joined
weights are views of one tensor, the state dict keeps its values, the outputs equal the separate GEMMs'; weights that
cannot be joined are left alone, and weights replaced after a join fall back to separate GEMMs."""

from __future__ import annotations

import torch

from deepinfer.backends.reference import ReferenceOps
from deepinfer.models.deepseek_v4.layers import Linear, join_rows, rows_forward, rows_fp32
from deepinfer.quant.formats import quantize_fp8_blocks

OPS = ReferenceOps()


def _fp8(k: int, n: int, seed: int, block: tuple[int, int] = (32, 32), quant_sim: bool = False) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, fp8=True)
    w, s = quantize_fp8_blocks(torch.randn(n, k, generator=g) * k**-0.5, block)
    lin.weight.data, lin.scale, lin.quant_sim = w, s, quant_sim
    return lin


def _bf16(k: int, n: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n)
    lin.weight.data = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    return lin


def _adjacent(ts: list[torch.Tensor]) -> bool:
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(ts, ts[1:]))


def test_fp8_projections_join_into_one_gemm():
    lins = [_fp8(128, 64, 1), _fp8(128, 96, 2), _fp8(128, 40, 3)]  # the last may end inside a row block
    x = torch.randn(5, 128)
    want = [lin(x, OPS) for lin in lins]
    state = {i: (lin.weight.clone(), lin.scale.clone()) for i, lin in enumerate(lins)}
    assert join_rows(lins)
    assert _adjacent([lin.weight for lin in lins]) and _adjacent([lin.scale for lin in lins])
    assert all(isinstance(lin.weight, torch.nn.Parameter) for lin in lins)
    for i, lin in enumerate(lins):
        assert torch.equal(lin.weight.view(torch.uint8), state[i][0].view(torch.uint8))
        assert torch.equal(lin.scale, state[i][1]) and "scale" in dict(lin.named_buffers())
    calls = []
    ops = ReferenceOps()
    ops.fp8_linear = lambda *a: calls.append(a[1].shape) or ReferenceOps.fp8_linear(ops, *a)
    got = rows_forward(x, lins, ops)
    assert calls == [(200, 128)]  # one GEMM over the joined rows
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fp32_projections_join_into_one_gemm():
    lins = [_bf16(64, 48, 4), _bf16(64, 48, 5), _bf16(64, 16, 6)]
    x = torch.randn(3, 64).bfloat16()
    want = [OPS.linear_fp32(x, lin.weight) for lin in lins]
    assert join_rows(lins)
    got = rows_fp32(x, lins, OPS)
    assert [t.shape for t in got] == [(3, 48), (3, 48), (3, 16)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_weights_that_cannot_be_joined_are_left_alone():
    cases = [
        [_fp8(128, 64, 1), _fp8(96, 64, 2)],  # another input width
        [_fp8(128, 40, 1), _fp8(128, 64, 2)],  # the first ends inside a row block: the scales would not line up
        [_fp8(128, 64, 1), _fp8(128, 64, 2, block=(64, 64))],  # other scale blocks
        [_fp8(128, 64, 1), _fp8(128, 64, 2, quant_sim=True)],  # other activation rounding
        [_fp8(128, 64, 1), _bf16(128, 64, 2)],  # other dtypes
        [_bf16(128, 64, 1)],  # nothing to join
    ]
    for lins in cases:
        before = [lin.weight.data_ptr() for lin in lins]
        assert not join_rows(lins)
        assert [lin.weight.data_ptr() for lin in lins] == before


def test_activation_roundings_set_apart_after_a_join_take_separate_gemms():
    lins = [_fp8(128, 64, 1), _fp8(128, 64, 2)]
    assert join_rows(lins)
    lins[1].quant_sim = True  # the official FP8 activations for one of them only
    x = torch.randn(3, 128) * 3
    got = rows_forward(x, lins, OPS)
    for a, lin in zip(got, lins):
        torch.testing.assert_close(a, lin(x, OPS), rtol=0, atol=0)
    assert not torch.equal(got[1], OPS.fp8_linear(x, lins[1].weight, lins[1].scale, False))  # the rounding bites


def test_weights_replaced_after_a_join_take_separate_gemms():
    lins = [_bf16(64, 32, 1), _bf16(64, 32, 2)]
    assert join_rows(lins)
    lins[1].weight.data = _bf16(64, 32, 9).weight.data  # a reload that replaces a tensor instead of copying into it
    x = torch.randn(2, 64).bfloat16()
    got = rows_fp32(x, lins, OPS)
    for a, lin in zip(got, lins):
        torch.testing.assert_close(a, OPS.linear_fp32(x, lin.weight), rtol=0, atol=0)


def test_v41_joined_projections_match_the_separate_ones():
    """A tiny V4.1 model (every attention kind, DSpark stages): ``wq_a`` with ``wkv`` joined by each attention's
    ``join_projections`` gives the logits of the separate GEMMs, prefill chunks and decode steps."""
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config
    from deepinfer.models.deepseek_v41.engram import compressed_token_map
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model
    from models.tiny_v41 import build_tokenizer, text_config

    tok = build_tokenizer()
    raw = {"model_type": "deepseek_v41", "text_config": text_config("sketch", tok),
           "vision_config": {"num_hidden_layers": 0}, "image_token_id": 3}  # fmt: skip
    model = DeepseekV41Model(DeepseekV41Config.from_dict(raw), OPS, engram_token_map=compressed_token_map(tok)[0])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", "q_weight", "k_weight")):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.3 if p.dim() == 1 or n.endswith(".fn") else p.shape[-1] ** -0.5, generator=g)
    model.eval()
    prompts = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (9, 8)]

    def run() -> list[torch.Tensor]:
        cache = PagedKVCache(model.config, 8, 8)
        states, tables = [SequenceState(), SequenceState()], [torch.arange(0, 4), torch.arange(4, 8)]
        out = []
        for lo, hi in ((0, 5), (5, 6), (6, 7)):  # a prefill chunk, then single tokens
            chunks = [SeqChunk(s, s.num_tokens, hi - lo, t) for s, t in zip(states, tables)]
            batch = ForwardBatch.build(chunks, [p[lo:hi] for p in prompts])
            out.append(model.logits(model(batch, cache)))
        return out

    want = run()
    attns = [m for m in model.modules() if hasattr(m, "join_projections")]
    for m in attns:
        m.join_projections()
    assert len(attns) > 2 and all(_adjacent([m.wq_a.weight, m.wkv.weight]) for m in attns)
    for a, b in zip(run(), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
