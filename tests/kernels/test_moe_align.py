"""The slot layout in one Triton program (deepinfer.kernels.moe_align) against the torch layout
(``padded_blocks(moe_layout(...))``) it replaces at decode sizes: identical slots and block experts, including
experts shared by many slots, more experts than slots, a whole number of blocks and the largest slot count; above
the limits the torch layout runs. In Triton's interpreter without a GPU, compiled on one."""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.kernels import moe_align  # noqa: E402
from deepinfer.kernels.moe_slots import moe_layout, padded_blocks  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_kernel = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")


def _routing(t, k, e, seed, pool=None):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.rand(t, pool or e, generator=g, device=DEVICE).argsort(dim=1)[:, :k]


@needs_kernel
@pytest.mark.parametrize(
    ("t", "k", "e", "block_m", "pool"),
    [
        (1, 6, 256, 16, None),  # one decode token, V4-Flash routing
        (64, 6, 256, 16, None),
        (341, 6, 256, 16, None),  # 2046 slots: the largest decode tile's T
        (40, 3, 8, 16, 3),  # few experts, each shared by many slots (hash-routed layers)
        (8, 2, 4, 16, None),  # 16 slots: whole blocks
        (5, 2, 300, 128, None),  # more experts than slots, prefill-sized blocks
    ],
)
def test_matches_the_torch_layout(t, k, e, block_m, pool):
    idx = _routing(t, k, e, seed=t + e, pool=pool)
    slots, bexp = moe_align.padded_slots(idx, e, block_m)
    ref_slots, ref_bexp = padded_blocks(moe_layout(idx, e), e, block_m)
    assert slots.dtype == bexp.dtype == torch.int32
    assert torch.equal(slots, ref_slots) and torch.equal(bexp, ref_bexp)


def test_above_the_limits_the_torch_layout_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(moe_align, "_align_kernel", calls)  # any launch would fail on a list
    idx = _routing(moe_align.MAX_SLOTS // 2 + 1, 2, 16, seed=1)
    slots, bexp = moe_align.padded_slots(idx, 16, 16)
    ref_slots, ref_bexp = padded_blocks(moe_layout(idx, 16), 16, 16)
    assert torch.equal(slots, ref_slots) and torch.equal(bexp, ref_bexp)
    empty = moe_align.padded_slots(idx[:0], 16, 16)
    assert empty[0].numel() == 0 and empty[1].numel() == 0
