"""Pinned plans (``deepinfer.kernels.pinning``): inside ``pinned()`` a kernel's launch is planned as for
``PLAN_ROWS`` rows, so a row's result is bit-identical whatever the call's row count, also past ``PLAN_ROWS`` (the
calls are taken in slices of as many rows); outside, plans follow the call (and the same rows may round otherwise).
And a model on the nvidia op set's batch-invariant mode (every op pinned). On CPU the kernels run in Triton's
interpreter."""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.kernels import pinning  # noqa: E402


def test_pinning_is_per_thread_and_nests():
    assert not pinning.is_pinned() and pinning.plan_rows(3) == 3 and pinning.row_slices(200) == [(0, 200)]
    seen = []
    with pinning.pinned():
        assert pinning.is_pinned() and pinning.plan_rows(3) == pinning.PLAN_ROWS
        assert pinning.row_slices(150) == [(0, 64), (64, 128), (128, 150)] and pinning.row_slices(5) == [(0, 5)]
        thread = threading.Thread(target=lambda: seen.append(pinning.is_pinned()))
        thread.start()
        thread.join()
        with pinning.pinned(False):
            assert not pinning.is_pinned()
        assert pinning.is_pinned()
    assert seen == [False] and not pinning.is_pinned()


def test_pinned_kernels_give_a_row_the_same_bits_in_any_batch():
    """The fixed-plan products of the batch-invariant mode and the kernels whose plans follow the row count: a row
    alone, among 40 rows and among 150 (past PLAN_ROWS: slices) is the same, bit for bit."""
    from deepinfer.kernels import fp8_gemm, hc_mixes, small_gemm
    from deepinfer.quant.formats import quantize_fp8_blocks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 256, generator=g)
    w = torch.randn(96, 256, generator=g) / 16
    wq, scale = quantize_fp8_blocks(w, (128, 128))
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        x, w, wq, scale = (t.cuda() for t in (x, w, wq, scale))
    fns = {
        "small_mm_fp32": lambda a: small_gemm.small_mm_fp32(a.bfloat16(), w.bfloat16()),
        "mixes_gemm": lambda a: hc_mixes.mixes_gemm(a.view(-1, 4, 64), w[:24]),
        "fp8_linear": lambda a: fp8_gemm.fp8_linear(a, wq, scale, act_quant=True),
    }
    with pinning.pinned():
        for name, fn in fns.items():
            alone, some, many = fn(x[:1]), fn(x[:40]), fn(x)
            assert torch.equal(alone[0], some[0]) and torch.equal(alone[0], many[0]), name
            assert torch.equal(some[39], many[39]), name
    one, some = fns["fp8_linear"](x[:1]), fns["fp8_linear"](x[:40])
    assert not torch.equal(one[0], some[0])  # unpinned: the gemv for one row, the W8A16 tiles for 40


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through the interpreter; on a GPU bench/engine/batch_invariance.py checks",
)
def test_the_fast_kernels_pinned_are_batch_invariant():
    """``NvidiaOps(invariant=True)``: the default set's kernels and batched paths (pooled decode state, the list
    attention), each launch planned for ``kernels.pinning.PLAN_ROWS`` rows: the target's logits are bit-identical
    alone and among other sequences (prefilling in chunks and decoding) with its own prefill chunked and a position
    decoded that was prefilled alone; with the default set they are not (so the check can fail); both compute the
    reference's function."""
    from bench.engine.compositions import target_logits
    from deepinfer.backends.nvidia import NvidiaOps
    from deepinfer.backends.reference import ReferenceOps
    from models.test_batch_invariance import PAGE, tokens
    from models.tiny_configs import in_memory

    # odd shapes, two layers (CSA with its indexer, HCA of ratio 16), a hash MoE layer, 3 mHC streams
    model = in_memory("odd", NvidiaOps(invariant=True), num_hidden_layers=2, compress_ratios=[4, 16, 0])
    assert model.pooled_decode and model.ops.batch_invariant and not model.ops.invariant_by_sequence
    vocab = model.config.vocab_size
    target, a, b = tokens(20, 1, vocab), tokens(7, 2, vocab), tokens(5, 3, vocab)
    # positions 16-19: prefilled then decoded alone; among others, its prefill in two chunks, position 16 decoded
    alone, mixed = ([target], [[17, 1, 1, 1]]), ([target, a, b], [[0, 4, 12, 1, 1, 1, 1], [3, 4], [1] * 5])
    got = [target_logits(model, seqs, p, None, PAGE)[-4:] for seqs, p in (alone, mixed)]
    assert torch.equal(got[0], got[1])
    model.ops = NvidiaOps()
    default = [target_logits(model, seqs, p, None, PAGE)[-4:] for seqs, p in (alone, mixed)]
    assert not torch.equal(default[0], default[1])
    model.ops = ReferenceOps()
    assert (target_logits(model, [target], [[20]], None, PAGE)[-1:] - got[0][-1:]).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "knob, value",
    [("fp8_gemm_config.PINNED_ROWS", 8), ("fp8_gemm_config.PINNED_ROWS", 16), ("fp8_gemm_config.PINNED_ROWS", 64),
     ("fp8_gemm_config.PINNED_ROWS_BY_SHAPE", {(96, 256): 8}), ("small_gemm.PINNED_ROWS", 16),
     ("small_gemm.PINNED_ROWS", 64), ("moe_mxfp4.PINNED_SPLIT", 1), ("moe_mxfp4.PINNED_SPLIT", 2),
     ("moe_mxfp4.PINNED_SPLIT", 4)],
)  # fmt: skip
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU tensors through the interpreter; on a GPU bench/kernels/pinned_plans.py checks each candidate",
)
def test_each_pinned_plan_candidate_keeps_a_row_s_bits(monkeypatch, knob, value):
    """The plans a kernel may pin in place of ``PLAN_ROWS``' (``bench/kernels/pinned_plans.py`` picks among them):
    with each, a row alone, among 9 rows and among 40 (past the plan's own rows: more tiles, the same tiles' sums) is
    the same, bit for bit; the MXFP4 experts under a pinned split too, and that split differs from the unsplit
    call's order (so the check can fail)."""
    from deepinfer.kernels import fp8_gemm, fp8_gemm_config, moe_mxfp4, small_gemm
    from deepinfer.quant.formats import quantize_fp8_blocks

    mod, name = knob.split(".")
    monkeypatch.setattr({"fp8_gemm_config": fp8_gemm_config, "small_gemm": small_gemm, "moe_mxfp4": moe_mxfp4}[mod],
                        name, value)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    if mod == "moe_mxfp4":
        from bench.harness import mxfp4_experts

        mx = mxfp4_experts(8, 64, 256, g, "cpu")  # K = 256 of both GEMMs: 4 steps of the interpreter's tiles
        x, idx = torch.randn(9, 256, generator=g), torch.rand(9, 8, generator=g).topk(2, dim=1).indices.int()
        w = torch.rand(9, 2, generator=g).softmax(-1)
        fn = lambda r: moe_mxfp4.moe_mxfp4(x[:r], idx[:r], w[:r], *mx, 10.0)  # noqa: E731
        rows = (1, 5, 9)
    else:
        x, w = torch.randn(40, 256, generator=g), torch.randn(96, 256, generator=g) / 16
        wq, scale = quantize_fp8_blocks(w, (128, 128))
        fn = (lambda r: fp8_gemm.fp8_linear(x[:r], wq, scale)) if mod != "small_gemm" else (
            lambda r: small_gemm.small_mm_fp32(x[:r].bfloat16(), w.bfloat16()))  # fmt: skip
        rows = (1, 9, 40)
    with pinning.pinned():
        alone, some, many = (fn(r) for r in rows)
        assert torch.equal(alone[0], some[0]) and torch.equal(alone[0], many[0])
        assert torch.equal(some[rows[1] - 1], many[rows[1] - 1])
    if mod == "moe_mxfp4" and value == 2:  # unpinned on the CPU: one piece (4 pieces of K = 256: one K step each, the
        assert not torch.equal(fn(1)[0], alone[0])  # unsplit order)


def test_a_pinned_plan_out_of_range_is_refused(monkeypatch):
    from deepinfer.kernels import fp8_gemm, fp8_gemm_config, moe_mxfp4
    from deepinfer.quant.formats import quantize_fp8_blocks

    # (on a GPU machine the check is the kernel path's: CPU tensors there take the reference's math)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    wq, scale = (t.to(dev) for t in quantize_fp8_blocks(torch.randn(64, 128), (128, 128)))
    monkeypatch.setattr(fp8_gemm_config, "PINNED_ROWS", fp8_gemm_config.GEMV_MAX_M)  # the gemv: one launch per row
    with pinning.pinned(), pytest.raises(ValueError, match="pinned rows"):
        fp8_gemm.fp8_linear(torch.randn(3, 128, device=dev), wq, scale)
    monkeypatch.setattr(moe_mxfp4, "PINNED_SPLIT", 0)
    with pinning.pinned(), pytest.raises(ValueError, match="PINNED_SPLIT"):
        moe_mxfp4.splits_mxfp4(6, 8, 64, 64, moe_mxfp4.MX_INTERPRET)


def test_the_op_set_names_every_pinned_plan_constant(monkeypatch):
    """``requires["ops"]`` of a batch-invariant response changes with each constant that changes pinned results."""
    from deepinfer.backends.nvidia.invariant import invariance_name
    from deepinfer.kernels import fp8_gemm_config, invariant, moe_mxfp4, small_gemm

    names = {invariance_name()}
    changes = [(fp8_gemm_config, "PINNED_ROWS", 16), (fp8_gemm_config, "PINNED_ROWS_BY_SHAPE", {(512, 4096): 16}),
               (small_gemm, "PINNED_ROWS", 16), (moe_mxfp4, "PINNED_SPLIT", 3),
               (invariant, "MATMUL_PLAN", (64, 32, 16, 4, 3)),
               (invariant, "MATMUL_PLAN_FP32", (64, 32, 16, 4, 3))]  # fmt: skip
    for mod, name, value in changes:
        monkeypatch.setattr(mod, name, value)
        names.add(invariance_name())
    name = invariance_name()
    assert len(names) == 7 and "fp8_rows512x4096=16" in name and "head_plan=64x32x16x4x3" in name
