"""Routed-expert MoE kernels (deepinfer.kernels.moe) against ``ReferenceOps.moe``.

Without a GPU the Triton kernels run in the interpreter (fp32, tiny shapes) and ``torch._grouped_mm`` uses torch's
CPU fallback; on a CUDA machine with ``TRITON_INTERPRET`` unset the same tests compile and run for real, plus bf16
checks at V4-Flash's expert shapes and a check that no call synchronises the host.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels.moe import (  # noqa: E402
    MOE_LARGE,
    MOE_SMALL,
    moe_grouped_mm,
    moe_triton,
    pick_config,
    stage_bytes,
)
from deepinfer.kernels.moe_slots import moe_layout, padded_blocks  # noqa: E402
from deepinfer.kernels.shared_memory import SHARED_MEMORY, fit_stages  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")


def _problem(t, e, i, d, k, seed, dtype=torch.float32, hashed=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)  # drawn where they are used: the real shapes are 6 GB

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dtype)

    x, w1, w3, w2 = (
        randn(t, d),
        randn(e, i, d, scale=d**-0.5),
        randn(e, i, d, scale=d**-0.5),
        randn(e, d, i, scale=i**-0.5),
    )
    pool = min(e, k + 1) if hashed else e  # hashed: few experts, heavily shared (a hash table's repeats)
    idx = torch.rand(t, pool, generator=g, device=DEVICE).argsort(dim=1)[:, :k]
    w = torch.rand(t, k, generator=g, device=DEVICE) * 1.5
    return x, idx, w, w1, w2, w3


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("impl", ["grouped_mm", "triton"])
@pytest.mark.parametrize(("t", "hashed"), [(1, False), (13, False), (40, True)])
def test_moe_matches_reference_fp32(impl, t, hashed):
    x, idx, w, w1, w2, w3 = _problem(t, 8, 48, 40, 3, seed=t, hashed=hashed)
    ref = ReferenceOps().moe(x, idx, w, w1, w2, w3, 0.7)  # a tight limit: the clamps bite
    fn = moe_grouped_mm if impl == "grouped_mm" else moe_triton
    out = fn(x, idx, w, w1, w2, w3, 0.7)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("impl", ["grouped_mm", "triton"])
def test_hidden_rounding_is_act_quant(impl):
    """``hidden`` (``NvidiaOps.moe(act_quant=True)``'s rounding of the hidden rows) on an input rounded alike gives
    ``ReferenceOps.moe(act_quant=True)``: the official FP8 activations of the experts' two GEMMs."""
    x, idx, w, w1, w2, w3 = _problem(9, 6, 128, 128, 2, seed=3)
    ops = ReferenceOps()
    ref = ops.moe(x, idx, w, w1, w2, w3, 10.0, act_quant=True)
    fn = moe_grouped_mm if impl == "grouped_mm" else moe_triton
    xq = ops.act_quant_sim(x, 128)
    out = fn(xq, idx, w, w1, w2, w3, 10.0, hidden=lambda h: ops.act_quant_sim(h, 128))
    assert _rel(out, ref) < 1e-5
    assert _rel(fn(xq, idx, w, w1, w2, w3, 10.0), ref) > 1e-3  # the hidden rounding matters


def test_moe_empty_batch():
    x, idx, w, w1, w2, w3 = _problem(0, 4, 16, 16, 2, seed=0)
    for fn in (moe_grouped_mm, moe_triton):
        assert fn(x, idx, w, w1, w2, w3, 1.0).shape == (0, 16)


def test_layout_pads_each_expert_to_whole_blocks():
    idx = torch.tensor([[3, 0], [3, 1], [0, 3]])
    lay = moe_layout(idx, 5)
    assert lay.ends.tolist() == [2, 3, 3, 6, 6]
    assert lay.order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: token order within an expert
    slots, bexp = padded_blocks(lay, 5, 4)
    tk = idx.numel()
    assert slots.numel() % 4 == 0 and bexp.numel() == slots.numel() // 4
    used = bexp < 5
    assert bexp[used].tolist() == [0, 1, 3]  # one block each for experts 0, 1, 3; none for the empty ones
    s = slots.view(-1, 4)
    assert s[0].tolist() == [1, 4, tk, tk] and s[1].tolist() == [3, tk, tk, tk] and s[2].tolist() == [0, 2, 5, tk]
    assert (s[~used] == tk).all()


def test_bad_inputs_raise():
    x, idx, w, w1, w2, w3 = _problem(3, 4, 24, 16, 2, seed=1)
    with pytest.raises(ValueError):
        moe_triton(x, idx, w, w1, w2.transpose(1, 2), w3, 1.0)
    with pytest.raises(ValueError):
        moe_grouped_mm(x.double(), idx, w, w1, w2, w3, 1.0)


@gpu_only
@pytest.mark.parametrize("t", [1, 64, 700])
def test_gpu_bf16_real_shapes(t):
    x, idx, w, w1, w2, w3 = _problem(t, 256, 2048, 4096, 6, seed=t, dtype=torch.bfloat16)
    ref = ReferenceOps().moe(x, idx, w, w1, w2, w3, 10.0)
    for out in (
        moe_grouped_mm(x, idx, w, w1, w2, w3, 10.0),
        moe_triton(x, idx, w, w1, w2, w3, 10.0, config=MOE_SMALL),
        moe_triton(x, idx, w, w1, w2, w3, 10.0, config=MOE_LARGE),
    ):
        assert _rel(out, ref) < 1e-2


def test_fp32_tiles_fit_the_shared_memory():
    """The tiles are sized for bf16; fp32 operands take fewer pipeline stages so that a block's shared memory fits
    (the large tiles' three fp32 stages need 240 KiB, past the H200's 227 KiB)."""
    for slots in (6, 64 * 6, 4096 * 6):
        bf16, fp32 = pick_config(slots, 64), pick_config(slots, 64, elem_bytes=4)
        assert bf16 in (MOE_SMALL, MOE_LARGE) and fp32.num_stages < bf16.num_stages
        assert fp32.num_stages * stage_bytes(fp32, 4) <= SHARED_MEMORY
        assert (fp32.block_m, fp32.block_n, fp32.block_k) == (bf16.block_m, bf16.block_n, bf16.block_k)
    assert MOE_LARGE.num_stages * stage_bytes(MOE_LARGE, 4) > SHARED_MEMORY
    assert pick_config(10**6, 64) is MOE_LARGE and fit_stages(3, 10**6) == 1 and fit_stages(4, 1000, limit=2500) == 2


@gpu_only
@pytest.mark.parametrize("t", [2, 256])
def test_gpu_fp32_tiles_launch(t):
    """fp32 experts at both tile sizes: the launch fits the shared memory and matches the reference."""
    x, idx, w, w1, w2, w3 = _problem(t, 8, 64, 128, 6, seed=t, dtype=torch.float32)
    ref = ReferenceOps().moe(x, idx, w, w1, w2, w3, 10.0)
    assert _rel(moe_triton(x, idx, w, w1, w2, w3, 10.0), ref) < 1e-5


@gpu_only
def test_gpu_no_host_sync():
    from deepinfer.backends.nvidia import NvidiaOps

    x, idx, w, w1, w2, w3 = _problem(33, 32, 256, 512, 6, seed=2, dtype=torch.bfloat16)
    for backend in ("grouped_mm", "triton"):
        ops = NvidiaOps(moe_backend=backend)
        ops.moe(x, idx, w, w1, w2, w3, 10.0)  # compile / load first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ops.moe(x, idx, w, w1, w2, w3, 10.0)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="the kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(("t", "k", "d"), [(1, 1, 8), (3, 6, 40), (5, 8, 1500)])
def test_combine_sums_each_tokens_slots_in_order(t: int, k: int, d: int):
    """``combine`` (one kernel on CUDA / in the interpreter) equals the fp32 sum of a token's slots taken in slot
    order, bit for bit, for bf16 and fp32 slot outputs."""
    from deepinfer.kernels.moe import combine

    g = torch.Generator().manual_seed(t * k)
    for dtype in (torch.float32, torch.bfloat16):
        o = (torch.randn(t * k, d, generator=g) * 100).to(dtype)
        want = o.view(t, k, d)[:, 0].float()
        for j in range(1, k):
            want = want + o.view(t, k, d)[:, j].float()
        got = combine(o.to(DEVICE), t, k)
        assert got.dtype == torch.float32 and torch.equal(got.cpu(), want)
