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
