"""DeepSeek-V4.1's cache round trips in one Triton kernel each (deepinfer.kernels.cache_round) against the torch
versions (deepinfer.quant.cache), bit for bit: random rows over many magnitudes, the E4M3 / E2M1 ties and
saturations, signed zeros, a trailing partial block, bf16 and fp32. In Triton's interpreter without a GPU.

The torch versions run on the CPU: they define the round trips (row 1 holds blocks whose NVFP4 scale saturates)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.kernels.cache_round import cache_round  # noqa: E402
from deepinfer.quant.cache import fp8_window_round, mxfp4_round, nvfp4_round  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
TORCH = {"fp8": fp8_window_round, "nvfp4": nvfp4_round, "mxfp4": mxfp4_round}


def _rows(n, width, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.logspace(-8, 3, n, device=DEVICE).unsqueeze(1)  # every row its own magnitude
    x = torch.randn(n, width, generator=g, device=DEVICE) * scale
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, -0.25, -0.0, 0.0, 1e-30] * 4)  # E2M1 ties
    x[0, : min(48, width)] = ties[:width]
    x[1, :16] = torch.tensor([448.0, 464.0, 480.0, 1e6, 2**-10, 3 * 2**-11, 2**-6, -(2**-10)] * 2)  # E4M3 edges
    return x.to(dtype)


@pytest.mark.parametrize("fmt", sorted(TORCH))
@pytest.mark.parametrize(("dtype", "width"), [(torch.float32, 512), (torch.bfloat16, 512), (torch.bfloat16, 40)])
def test_bit_identical_to_the_torch_round_trip(fmt, dtype, width):
    x = _rows(37, width, dtype, seed=width)
    got, ref = cache_round(x, fmt).cpu(), TORCH[fmt](x.cpu())
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip


def test_leading_dims_empty_and_bad_format():
    x = _rows(12, 64, torch.bfloat16, seed=3).view(3, 4, 64)
    assert torch.equal(cache_round(x, "mxfp4").cpu(), mxfp4_round(x.cpu()))
    assert cache_round(x[:0], "nvfp4").shape == (0, 4, 64)
    with pytest.raises(ValueError, match="format"):
        cache_round(x, "fp4")
