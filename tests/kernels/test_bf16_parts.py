"""The fp32 × bf16 head product by exact bf16 parts (``deepinfer.backends.nvidia.bf16_parts``) against the reference's
fp32 GEMM, and the lossless narrowing of a widened head (``NvidiaOps.prepare_weights``)."""

import pytest
import torch

from deepinfer.backends.nvidia.bf16_parts import bf16_parts, linear_by_parts, narrow_lossless
from deepinfer.backends.reference import ReferenceOps

CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _y(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, k), generator=g).float())
    y[0, :3] = torch.tensor([1.0 + 2.0**-23, -(2.0**-126), 3.0e38])  # 24 significant bits, the smallest normal, huge
    return y


def test_three_bf16_parts_sum_to_the_fp32_value_exactly():
    y = _y(64, 257, seed=1)
    parts = bf16_parts(y)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 64, 257)
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), y)
    bf = y.to(torch.bfloat16).float()  # a bf16-valued tensor: the lower parts are zeros
    assert torch.equal(bf16_parts(bf)[1:].float(), torch.zeros(2, 64, 257))


def test_narrow_lossless_keeps_bf16_values_only():
    w = torch.nn.Parameter(torch.randn(10, 8).to(torch.bfloat16).float())
    assert narrow_lossless(w, rows=3) and w.dtype == torch.bfloat16
    v = torch.nn.Parameter(torch.randn(10, 8).to(torch.bfloat16).float())
    v.data[9, 7] += 2.0**-20  # one element a bf16 cannot hold, in the last chunk
    assert not narrow_lossless(v, rows=3) and v.dtype == torch.float32
    assert not narrow_lossless(w)  # already bf16


@gpu_only
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: two chunks of ROWS
def test_linear_by_parts_is_the_fp32_gemm(rows):
    k, n = 1024, 3000
    g = torch.Generator().manual_seed(rows)
    y = (torch.randn(rows, k, generator=g) * 3).cuda()
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16).cuda()
    ref = ReferenceOps().logits_linear(y, w)  # fp32 y, w widened to fp32
    out = linear_by_parts(y, w)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5  # the order of the fp32 sums alone (~1e-6 at K = 1024)
    assert ((y.to(torch.bfloat16).float() @ w.float().t() - ref).norm() / ref.norm()).item() > 1e-4  # not y in bf16


@gpu_only
def test_nvidia_ops_narrow_a_widened_head_and_use_the_parts():
    from deepinfer.backends.nvidia import NvidiaOps

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(256, 500, bias=False).cuda()
            self.head.weight.data = self.head.weight.data.to(torch.bfloat16).float()  # the loader's widened bf16

    torch.manual_seed(5)
    ops, net = NvidiaOps(), Net()
    y = torch.randn(3, 256, device="cuda")
    ref = ReferenceOps().logits_linear(y, net.head.weight)
    ops.prepare_weights(net)
    assert net.head.weight.dtype == torch.bfloat16
    out = ops.logits_linear(y, net.head.weight)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
