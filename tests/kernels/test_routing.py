"""``deepinfer.kernels.routing``: the router epilogue (``route``) against V4's ``Gate`` arithmetic in torch, and the
shared expert's SwiGLU (``swiglu``) against ``backends.reference.swiglu``. Without a GPU the kernels run in Triton's
interpreter on host tensors; on a CUDA machine with ``TRITON_INTERPRET`` unset, at V4-Flash's router shapes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.backends.reference import swiglu as ref_swiglu  # noqa: E402
from deepinfer.kernels.routing import route, swiglu  # noqa: E402

REF = ReferenceOps()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
runs = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")


def reference(logits, bias, k, scaling, idx=None):
    """``deepseek_v4.moe.Gate`` after its GEMM, in torch (on the CPU)."""
    scores = F.softplus(logits.float()).sqrt()
    if idx is None:
        idx = REF.topk_indices(scores + bias.float(), k) if bias is not None else REF.topk_indices(scores, k)
    w = scores.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * scaling


@runs
@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (5, 256, 6), (3, 384, 6), (2, 64, 32)])
def test_route_matches_the_gate(t: int, e: int, k: int):
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(t, e, generator=g) * 3
    logits[0, :4] = 25.0  # above softplus's threshold: the identity
    bias = torch.randn(e, generator=g) * 0.1
    idx, w = route(logits.to(DEVICE), bias.to(DEVICE), k, 1.5)
    ref_idx, ref_w = reference(logits, bias, k, 1.5)
    assert torch.equal(idx.cpu(), ref_idx)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=4e-7, atol=0)


@runs
def test_route_ties_go_to_the_lower_expert_and_hash_layers_keep_their_experts():
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, -1.0, 2.0, 0.5, -3.0]] * 2)
    logits[1] = logits[1].flip(0)
    for bias in (None, torch.zeros(8), torch.tensor([0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0])):
        idx, w = route(logits.to(DEVICE), None if bias is None else bias.to(DEVICE), 4, 2.0)
        ref_idx, ref_w = reference(logits, bias, 4, 2.0)
        assert torch.equal(idx.cpu(), ref_idx)
        torch.testing.assert_close(w.cpu(), ref_w, rtol=4e-7, atol=0)
    given = torch.tensor([[7, 0, 3], [1, 1, 6]])
    idx, w = route(logits.to(DEVICE), None, 3, 1.0, idx=given.to(DEVICE))
    assert torch.equal(idx.cpu(), given)
    torch.testing.assert_close(w.cpu(), reference(logits, None, 3, 1.0, given)[1], rtol=4e-7, atol=0)
    with pytest.raises(ValueError, match="idx"):
        route(logits, None, 2, 1.0, idx=given)
    with pytest.raises(ValueError, match="experts"):
        route(torch.zeros(1, 8), None, 9, 1.0)


@runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_the_reference(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(3, 2, 1500, generator=g) * 8).to(dtype)
    up = (torch.randn(3, 2, 1500, generator=g) * 8).to(dtype)
    out = swiglu(gate.to(DEVICE), up.to(DEVICE), 7.0, dtype)
    want = ref_swiglu(gate.to(DEVICE).float(), up.to(DEVICE).float(), 7.0).to(dtype)  # torch on the same device
    assert out.dtype == dtype and out.shape == gate.shape
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)  # an ulp of each
    torch.testing.assert_close(out, want, **tol)
    with pytest.raises(ValueError, match="differ"):
        swiglu(gate, up[..., :3], 7.0, dtype)
