"""``Ops.parallel`` (``backends.nvidia.streams.StreamOps``): two independent pieces of work forked onto a side stream
and joined back, the MoE's shared expert beside its routed experts.

On the CPU: the branches run one after the other, in order, and the split-K tickets are per lane. On a CUDA machine:
a V4 MoE layer (MXFP4 experts, FP8 shared expert, split-K GEMMs with tickets in both branches) gives the same
output bit for bit with and without the side stream, eagerly and replayed from a CUDA graph; and split-K GEMMs run
concurrently on the two lanes many times keep their results (shared tickets would mix them up).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.nvidia.streams import StreamOps  # noqa: E402
from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.kernels import small_gemm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA with TRITON_INTERPRET unset")


def test_parallel_off_cuda_runs_in_order():
    order = []
    for ops in (ReferenceOps(), StreamOps()):
        out = ops.parallel(lambda: order.append("a") or 1, lambda: order.append("b") or 2, torch.device("cpu"))
        assert out == (1, 2)
    assert order == ["a", "b", "a", "b"]


def test_tickets_are_per_lane():
    dev = torch.device("cpu")
    main = small_gemm.counters(dev)
    token = small_gemm.LANE.set(1)
    try:
        side = small_gemm.counters(dev)
        assert small_gemm.ready(dev)
    finally:
        small_gemm.LANE.reset(token)
    assert side.data_ptr() != main.data_ptr() and small_gemm.counters(dev).data_ptr() == main.data_ptr()


def _moe_layer():
    from deepinfer.checkpoint.tiny import TINY_V4
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.moe import MoE
    from deepinfer.ops import get_ops
    from deepinfer.quant.native import prepare_native

    wide = {"hidden_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 32, "num_experts_per_tok": 6}
    config = DeepseekV4Config.from_dict({**TINY_V4, **wide})
    ops = get_ops("nvidia")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = MoE(config, layer_id=config.num_hash_layers).to(torch.bfloat16)  # score-routed
        for p in m.parameters():
            p.data.normal_(0, 0.05)
    prepare_native(m, tuple(config.weight_block_size), quantize=True)
    ops.prepare_weights(m)
    return m, ops


@gpu_only
@pytest.mark.parametrize("t", [1, 16, 300])
def test_gpu_moe_overlap_is_bit_identical(t):
    m, ops = _moe_layer()
    x = torch.randn(t, 1024, device=DEVICE, dtype=torch.bfloat16)
    ops.overlap = False
    ref = m(x, None, ops)
    ops.overlap = True
    assert torch.equal(m(x, None, ops), ref)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m(x, None, ops)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x, None, ops)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ops.overlap = False
    assert torch.equal(out, m(x, None, ops))


@gpu_only
def test_gpu_split_k_on_both_lanes_at_once():
    """Split-K GEMMs with tickets (one output tile, many K pieces) on the two lanes of ``Ops.parallel`` at once,
    many rounds: each result is its GEMM's own."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    xa, xb = (torch.randn(8, 16384, generator=g, device=DEVICE).bfloat16() for _ in range(2))
    wa, wb = (torch.randn(64, 16384, generator=g, device=DEVICE).bfloat16() for _ in range(2))
    ref_a, ref_b = small_gemm.small_mm_fp32(xa, wa), small_gemm.small_mm_fp32(xb, wb)
    ops = StreamOps()
    dev = torch.device(DEVICE)
    for _ in range(200):
        a, b = ops.parallel(lambda: small_gemm.small_mm_fp32(xa, wa), lambda: small_gemm.small_mm_fp32(xb, wb), dev)
        assert torch.equal(a, ref_a) and torch.equal(b, ref_b)
