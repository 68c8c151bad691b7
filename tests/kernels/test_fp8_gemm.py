"""FP8 block-scaled GEMMs (deepinfer.kernels.fp8_gemm) against ``F.linear`` on the dequantised weight.

Without a GPU the Triton kernels run in the interpreter (fp32 activations, tiny shapes: the interpreter's bf16 math
is wrong); on a CUDA machine with ``TRITON_INTERPRET`` unset the same tests compile for real, plus bf16 checks at
DeepSeek-V4-Flash's dense shapes on both paths and bit-reproducibility of split-K (twice, and eager vs graph replay).
"""

import functools
import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels.fp8_gemm import (  # noqa: E402
    GEMV_MAX_M,
    GemmConfig,
    act_quant_fp8,
    fp8_grouped_linear,
    fp8_linear,
    pick_config,
)
from deepinfer.kernels.fp8_gemm_config import SMALL_M_MAX, SMALL_M_TILES  # noqa: E402
from deepinfer.kernels.shared_memory import SHARED_MEMORY  # noqa: E402
from deepinfer.quant.formats import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")

# DeepSeek-V4-Flash dense FP8 linears (N, K)
V4_SHAPES = {
    "wq_a": (1024, 4096),
    "wq_b": (32768, 1024),
    "wkv": (512, 4096),
    "wo_b": (4096, 8192),
    "shared_w13": (2048, 4096),
    "shared_w2": (4096, 2048),
    "idx_wq_b": (8192, 1024),
}


@functools.lru_cache(maxsize=16)  # quantize_fp8_blocks runs on the CPU: the real shapes are made once
def _weight(n, k, block, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=DEVICE) * k**-0.5
    # magnitudes that change every 32 rows / columns, so every scale block differs and a wrong scale index shows
    rows = torch.randint(-3, 4, (-(-n // 32),), generator=g, device=DEVICE).repeat_interleave(32)[:n]
    cols = torch.randint(-3, 4, (-(-k // 32),), generator=g, device=DEVICE).repeat_interleave(32)[:k]
    w = w * torch.exp2((rows[:, None] + cols[None, :]).float())
    q, s = quantize_fp8_blocks(w.cpu(), block)
    return q.to(DEVICE), s.float().to(DEVICE)


def _x(m, k, seed, dtype=torch.float32, lead=()):
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1000)
    x = torch.randn(*lead, m, k, generator=g, device=DEVICE)
    x[..., :7] *= 40.0  # outliers inside some quantisation blocks
    return x.to(dtype)


def _reference(x, w, s, act_quant):
    xq = ReferenceOps().act_quant_sim(x, 128) if act_quant else x
    wd = dequantize_fp8_blocks(w, s, dtype=torch.float32)
    return (xq.float() @ wd.t()).to(x.dtype)  # fp32 accumulation, rounded once


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


CPU_CONFIGS = {  # every W8A16 variant at interpreter-sized tiles (None: pick_config's choice, gemv up to 4 rows)
    "auto": None,
    "weight": GemmConfig(16, 32, 128, num_stages=1),  # 128 > a 32 K block: scales expanded per column
    "k32": GemmConfig(16, 32, 32, num_stages=1, fuse_quant=False),
    "x": GemmConfig(16, 32, 128, num_stages=1, scale_x=True),
    "dequant": GemmConfig(16, 32, 128, path="dequant"),
    "prepass": GemmConfig(16, 32, 128, num_stages=1, fuse_quant=False),
    "gemv": GemmConfig(1, 16, 256, num_stages=1, path="gemv"),
    "gemv4": GemmConfig(4, 16, 128, num_stages=1, path="gemv"),
}


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("variant", list(CPU_CONFIGS))
@pytest.mark.parametrize(
    ("m", "n", "k", "block"), [(1, 200, 256, 128), (3, 96, 384, 128), (5, 160, 384, 32), (33, 160, 256, 128)]
)
def test_w8a16_matches_reference_fp32(m, n, k, block, act_quant, variant):
    cfg = CPU_CONFIGS[variant]
    if cfg is not None and cfg.path == "gemv" and m > cfg.block_m:
        pytest.skip("gemv is for at most block_m rows")
    w, s = _weight(n, k, (block, block), seed=m + n)
    x = _x(m, k, seed=m)
    out = fp8_linear(x, w, s, act_quant=act_quant, config=cfg)
    ref = _reference(x, w, s, act_quant)
    assert out.dtype == x.dtype and out.shape == (m, n)
    picked = cfg or pick_config(m, n, k, (block, block), act_quant)
    # "auto" with act_quant from 16 rows is the FP8 MMA (swap_ab W8A8): its tolerance on a GPU (see the W8A8 test)
    assert _rel(out, ref) < (1e-3 if picked.path == "w8a8" and DEVICE == "cuda" else 1e-5)


def test_fp32_activations_take_the_stages_that_fit(monkeypatch):
    """The w8a16 tiles are sized for bf16 activations; fp32 ones at 128 rows a tile take two stages instead of three
    (three need 240 KiB of shared memory, past the H200's 227 KiB: the launch failed), bf16 ones keep three."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for m in (100, 256, 500):
        bf16 = pick_config(m, 1024, 4096, (128, 128), False)
        fp32 = pick_config(m, 1024, 4096, (128, 128), False, 132, 4)
        assert (bf16.path, bf16.block_m, bf16.num_stages) == ("w8a16", 128, 3)
        assert replace(fp32, num_stages=3) == bf16 and fp32.num_stages == 2
        assert fp32.num_stages * (fp32.block_m * 4 + fp32.block_n) * fp32.block_k <= SHARED_MEMORY
    small = pick_config(48, 1024, 4096, (128, 128), False, 132, 4)
    assert small.block_m == 64 and small.num_stages == 3  # 144 KiB fit


def test_a_few_rows_take_the_tiles_measured_for_their_shape(monkeypatch):
    """From ``GEMV_MAX_M + 1`` to ``SMALL_M_MAX`` rows a V4-Flash shape takes its measured W8A16 tiles (block_n,
    split_k); more rows, and shapes not measured, take the rule."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for (n, k), (bn, split) in SMALL_M_TILES.items():
        for m in range(GEMV_MAX_M + 1, SMALL_M_MAX + 1):
            for act_quant in (False, True):
                cfg = pick_config(m, n, k, (128, 128), act_quant)
                assert (cfg.path, cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k) == ("w8a16", 16, bn, 128, split)
        assert pick_config(SMALL_M_MAX + 1, n, k, (128, 128), False) == pick_config(16, n, k, (128, 128), False)
    assert (1536, 4096) not in SMALL_M_TILES and pick_config(4, 1536, 4096, (128, 128), False) == pick_config(
        16, 1536, 4096, (128, 128), False
    )


def test_split_k_and_leading_dims():
    w, s = _weight(40, 1024, (128, 128), seed=3)  # a K tail of N: 40 rows in one 128-row scale block
    x = _x(3, 1024, seed=4, lead=(2,))[:, :, :]  # [2, 3, K]
    cfg = pick_config(6, 40, 1024, (128, 128), act_quant=False)
    assert cfg.split_k > 1 or not INTERPRET
    for act_quant in (False, True):
        for c in (None, GemmConfig(16, 32, 128, split_k=3, num_stages=1)):  # 8 K steps in 3 chunks: 3, 3, 2
            out = fp8_linear(x, w, s, act_quant, config=c)
            assert out.shape == (2, 3, 40)
            assert _rel(out, _reference(x, w, s, act_quant)) < 1e-5


@pytest.mark.parametrize("act_quant", [False, True])
def test_gemv_rows_are_computed_as_one_row(act_quant):
    """The gemv takes several rows (``pick_config``: up to ``GEMV_MAX_M``), each weight tile loaded once for all of
    them, and a row's sums run in the order of the one-row gemv: with the tiles ``pick_config`` gives one row, each
    of 2-4 rows is bit for bit what it is alone (no row reads another's values)."""
    w, s = _weight(96, 1024, (128, 128), seed=41)
    x = _x(4, 1024, seed=42)
    one = pick_config(1, 96, 1024, (128, 128), act_quant)
    assert one.path == "gemv" and pick_config(GEMV_MAX_M, 96, 1024, (128, 128), act_quant).path == "gemv"
    alone = torch.cat([fp8_linear(x[i : i + 1], w, s, act_quant, config=one) for i in range(4)])
    for m in range(2, 5):
        cfg = replace(one, block_m=1 << (m - 1).bit_length())
        assert torch.equal(fp8_linear(x[:m], w, s, act_quant, config=cfg), alone[:m])
    assert _rel(alone, _reference(x, w, s, act_quant)) < 1e-5
    assert pick_config(GEMV_MAX_M + 1, 96, 1024, (128, 128), act_quant).path != "gemv"
    assert pick_config(2, 16384, 1024, (128, 128), act_quant).path != "gemv"  # (wide outputs: the tensor cores)


@pytest.mark.parametrize("cfg", [GemmConfig(1, 16, 128, split_k=3, num_stages=1, path="gemv"),
                                 GemmConfig(4, 16, 128, split_k=3, num_stages=1, path="gemv"),
                                 GemmConfig(16, 32, 128, split_k=3, num_stages=1)])  # fmt: skip
def test_split_k_tickets_match_the_sum_kernel(cfg, monkeypatch):
    """Split-K summed by each tile's last program (tickets, ``SPLIT_TICKETS``) is the sum kernel's result bit for bit
    (the same order), and leaves the shared ticket counters at zero."""
    from deepinfer.kernels import fp8_gemm, small_gemm

    m = 3 if cfg.path == "gemv" and cfg.block_m > 1 else 1 if cfg.path == "gemv" else 5
    w, s = _weight(96, 1024, (128, 128), seed=31)
    x = _x(m, 1024, seed=32)
    fused = fp8_linear(x, w, s, config=cfg)
    assert not small_gemm.counters(x.device).any()
    monkeypatch.setattr(fp8_gemm, "SPLIT_TICKETS", False)
    assert torch.equal(fused, fp8_linear(x, w, s, config=cfg))
    assert _rel(fused, _reference(x, w, s, False)) < 1e-5


@pytest.mark.parametrize(("swap", "split"), [(False, 1), (True, 1), (True, 2)])
@pytest.mark.parametrize(("block", "block_n"), [((128, 128), 32), ((32, 128), 64)])  # one / two row blocks a tile
def test_w8a8_path_matches_reference_fp32(block, block_n, swap, split):
    """Both W8A8 kernels: tokens on the MMA's M side, or (``swap_ab``, few rows) the weight, split over K."""
    w, s = _weight(160, 384, block, seed=5)
    x = _x(20, 384, seed=6)
    cfg = GemmConfig(16, block_n, 128, split_k=split, num_stages=1, path="w8a8", swap_ab=swap)
    out = fp8_linear(x, w, s, act_quant=True, config=cfg)
    # Hopper's FP8 MMA (wgmma, from 64 weight rows a tile) adds its products in less than fp32 within each 128-wide
    # K block, as in DeepSeek's fp8_gemm, which also promotes to fp32 once a block: not an fp32 tolerance on a GPU
    assert _rel(out, _reference(x, w, s, True)) < (1e-5 if INTERPRET or DEVICE == "cpu" else 1e-3)


def test_non_contiguous_input_and_empty_rows():
    w, s = _weight(48, 256, (128, 128), seed=7)
    xt = _x(256, 6, seed=8).t()  # [6, 256] with strides (1, 6)
    assert not xt.is_contiguous()
    assert _rel(fp8_linear(xt, w, s), _reference(xt, w, s, False)) < 1e-5
    for aq in (False, True):
        out = fp8_linear(torch.zeros(0, 256, device=DEVICE), w, s, act_quant=aq)
        assert out.shape == (0, 48)
        assert fp8_linear(torch.zeros(2, 0, 256, device=DEVICE), w, s).shape == (2, 0, 48)


@pytest.mark.parametrize("block", [128, 32])
def test_act_quant_fp8_matches_act_quant_sim(block):
    x = _x(3, 256, seed=9)
    x[0, :128] *= 1e-9  # below the 1e-4 amax floor
    x[1, 5] = 448.0 * 0.75  # amax exactly 448·2^k / the power-of-two edge
    x[2, :64] = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, -(2.0**-11), -0.0] * 8) * 64
    q, sc = act_quant_fp8(x, block)
    assert q.dtype == torch.float8_e4m3fn and sc.dtype == torch.float32 and sc.shape == (3, 256 // block)
    deq = (q.float().view(3, -1, block) * sc[..., None]).view(3, 256)
    sim = ReferenceOps().act_quant_sim(x, block)
    assert torch.equal(deq, sim)
    assert torch.equal(torch.signbit(deq), torch.signbit(sim))
    assert torch.equal(sc, torch.exp2(torch.log2(sc).round()))  # powers of two


@pytest.mark.skipif(DEVICE != "cpu", reason="the torch fallback serves CPU tensors without the interpreter")
def test_cpu_fallback_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w, s = _weight(48, 256, (128, 128), seed=10)
    x = _x(3, 256, seed=10)
    for act_quant in (False, True):
        assert _rel(fp8_linear(x, w, s, act_quant), _reference(x, w, s, act_quant)) < 1e-6
    q, sc = act_quant_fp8(x)
    assert torch.equal((q.float().view(3, 2, 128) * sc[..., None]).view(3, 256), ReferenceOps().act_quant_sim(x, 128))


def test_bad_inputs_raise():
    w, s = _weight(48, 256, (128, 128), seed=1)
    x = _x(2, 256, seed=1)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        fp8_linear(x.double(), w, s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.float(), s)
    with pytest.raises(ValueError, match="does not end"):
        fp8_linear(x[:, :128], w, s)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, w, s[:, :1].contiguous(), block=(128, 128))
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, w, s.double())
    with pytest.raises(ValueError, match="act_quant needs K"):
        w2, s2 = _weight(16, 96, (32, 32), seed=2)
        fp8_linear(_x(2, 96, seed=2), w2, s2, act_quant=True)
    with pytest.raises(ValueError, match="multiple"):
        act_quant_fp8(x[:, :100])
    for cfg in (
        GemmConfig(16, 32, 128, path="w8a8"),
        GemmConfig(1, 16, 256, path="gemv"),
        GemmConfig(16, 256, 128, scale_x=True),
    ):
        with pytest.raises(ValueError, match="config"):
            fp8_linear(x, w, s, config=cfg)  # no act_quant / more rows than block_m / 256 rows across a 128-row block


@gpu_only
@pytest.mark.parametrize("name", list(V4_SHAPES))
@pytest.mark.parametrize("m", [1, 4, 7, 16, 64, 256, 1024])
def test_gpu_bf16_v4_flash_shapes(name, m):
    n, k = V4_SHAPES[name]
    w, s = _weight(n, k, (128, 128), seed=n + k)
    x = _x(m, k, seed=m, dtype=torch.bfloat16)
    for act_quant in (False, True):
        out, ref = fp8_linear(x, w, s, act_quant), _reference(x, w, s, act_quant)
        assert out.dtype == torch.bfloat16 and _rel(out, ref) < 3e-3, (name, m, act_quant, _rel(out, ref))
    if 16 <= m < 256:  # the W8A8 swap tiles against the W8A16 path's result
        cfg = GemmConfig(16 if m < 32 else 64, 128, 128, split_k=2, num_stages=4, path="w8a8", swap_ab=True)
        out = fp8_linear(x, w, s, True, config=cfg)
        assert _rel(out, _reference(x, w, s, True)) < 3e-3, _rel(out, _reference(x, w, s, True))
    if m >= 256:  # other FP8 tensor-core tiles, and the W8A16 kernel at large M
        out = fp8_linear(x, w, s, True, config=GemmConfig(128, 128, 128, num_warps=8, num_stages=4, path="w8a8"))
        assert _rel(out, _reference(x, w, s, True)) < 3e-3, _rel(out, _reference(x, w, s, True))
        out = fp8_linear(x, w, s, config=GemmConfig(128, 128, 128, num_warps=8))
        assert _rel(out, _reference(x, w, s, False)) < 3e-3, _rel(out, _reference(x, w, s, False))


@gpu_only
@pytest.mark.parametrize("m", [1, 16, 96])
def test_gpu_bf16_v41_blocks(m):
    w, s = _weight(1024, 4096, (32, 32), seed=11)
    x = _x(m, 4096, seed=m, dtype=torch.bfloat16)
    for act_quant in (False, True):
        out, ref = fp8_linear(x, w, s, act_quant), _reference(x, w, s, act_quant)
        assert _rel(out, ref) < 3e-3, (m, act_quant, _rel(out, ref))


@gpu_only
def test_gpu_act_quant_exact():
    x = _x(300, 4096, seed=12, dtype=torch.bfloat16)
    q, sc = act_quant_fp8(x)
    deq = (q.float().view(300, -1, 128) * sc[..., None]).view(300, 4096)
    assert torch.equal(deq.to(x.dtype), ReferenceOps().act_quant_sim(x, 128))


@gpu_only
@pytest.mark.parametrize("act_quant", [False, True])
def test_gpu_split_k_bit_reproducible_and_graph_safe(act_quant):
    n, k = V4_SHAPES["wkv"]
    w, s = _weight(n, k, (128, 128), seed=13)
    x = _x(4, k, seed=14, dtype=torch.bfloat16)
    assert pick_config(4, n, k, (128, 128), act_quant).split_k > 1
    a = fp8_linear(x, w, s, act_quant)
    b = fp8_linear(x, w, s, act_quant)
    assert torch.equal(a, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, w, s, act_quant)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w, s, act_quant)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a)
    x.copy_(_x(4, k, seed=15, dtype=torch.bfloat16))  # new input, same buffers
    graph.replay()
    assert torch.equal(out, fp8_linear(x, w, s, act_quant))


@gpu_only
def test_gpu_prefill_w8a8_takes_the_vendor_gemm():
    """From ``SCALED_MM_MIN_M`` rows, ``act_quant`` with 128×128 blocks runs ``torch._scaled_mm`` on an SM90 GPU
    (``fp8_scaled_mm``), within bf16 rounding of the reference and of the Triton W8A8 kernel."""
    from deepinfer.kernels import fp8_scaled_mm
    from deepinfer.kernels.fp8_gemm import SCALED_MM_MIN_M

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block-scaled _scaled_mm is an SM90 (Hopper) kernel")
    assert fp8_scaled_mm.available(torch.device(DEVICE))
    n, k = V4_SHAPES["wo_b"]
    w, s = _weight(n, k, (128, 128), seed=21)
    x = _x(SCALED_MM_MIN_M, k, seed=22, dtype=torch.bfloat16)
    q, sa = act_quant_fp8(x)
    vendor = fp8_scaled_mm.block_scaled_mm(q, sa, w, s, torch.bfloat16)
    assert torch.equal(fp8_linear(x, w, s, True), vendor)  # the path taken
    ref = _reference(x, w, s, True)
    triton_w8a8 = fp8_linear(x, w, s, True, config=GemmConfig(128, 128, 128, num_warps=8, num_stages=4, path="w8a8"))
    assert _rel(vendor, ref) < 3e-3 and _rel(vendor, triton_w8a8) < 3e-3


def _grouped_reference(x, w, s):
    g, k = x.shape[1], x.shape[2]
    wd = dequantize_fp8_blocks(w, s, dtype=torch.float32).view(g, -1, k)
    return torch.einsum("tgk,grk->tgr", x.float(), wd).to(x.dtype)


@pytest.mark.parametrize(
    "cfg",
    [None, GemmConfig(1, 16, 128, split_k=2, num_stages=1, path="gemv"), GemmConfig(16, 32, 128, num_stages=1),
     GemmConfig(4, 16, 128, split_k=2, num_stages=1, path="gemv"),
     GemmConfig(16, 32, 128, split_k=2, num_stages=1), GemmConfig(16, 32, 128, path="dequant")],
)  # fmt: skip
@pytest.mark.parametrize("t", [1, 3, 5])
def test_grouped_linear_matches_einsum(t, cfg):
    """``wo_a``: each group of 64 weight rows meets its own 256 columns of x (4 groups, 32-row scale blocks)."""
    if cfg is not None and cfg.path == "gemv" and t > cfg.block_m:
        pytest.skip("gemv is for at most block_m rows")
    w, s = _weight(4 * 64, 256, (32, 32), seed=21)
    x = _x(t, 4 * 256, seed=22).view(t, 4, 256)
    out = fp8_grouped_linear(x, w, s, config=cfg)
    assert out.shape == (t, 4, 64) and out.dtype == x.dtype
    assert _rel(out, _grouped_reference(x, w, s)) < 1e-5
    ops = ReferenceOps()
    assert _rel(ops.fp8_grouped_linear(x, w, s), _grouped_reference(x, w, s)) < 1e-5


def test_grouped_linear_bad_inputs():
    w, s = _weight(4 * 64, 256, (32, 32), seed=21)
    with pytest.raises(ValueError, match="T, G, K"):
        fp8_grouped_linear(_x(2, 256, seed=1), w, s)
    with pytest.raises(ValueError, match="groups"):
        fp8_grouped_linear(_x(2, 3 * 256, seed=1).view(2, 3, 256), w, s)
    assert fp8_grouped_linear(torch.zeros(0, 4, 256, device=DEVICE), w, s).shape == (0, 4, 64)


@gpu_only
@pytest.mark.parametrize("m", [1, 16, 64, 1024])
def test_gpu_grouped_linear_v4_wo_a(m):
    """V4-Flash's ``wo_a``: 8 groups of 1024 rows over 4096 columns each, bf16, against the bf16 einsum."""
    w, s = _weight(8 * 1024, 4096, (128, 128), seed=23)
    x = _x(m, 8 * 4096, seed=24, dtype=torch.bfloat16).view(m, 8, 4096)
    out = fp8_grouped_linear(x, w, s)
    assert out.dtype == torch.bfloat16 and _rel(out, _grouped_reference(x, w, s)) < 3e-3
