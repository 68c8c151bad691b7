"""A compressor's group pooling in one Triton kernel (deepinfer.kernels.group_pool) against its torch reference, and
the reference against ``Compressor._rows``'s torch path bit for bit. Groups are read from ring buffers by index
(``slot · cap + pos % cap``: indices that wrap and repeat), with ``has_prev`` and ``live`` mixed, scores with
``-inf`` entries and large magnitudes. In Triton's interpreter without a GPU (fp32: the interpreter's bf16 is wrong)."""

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.backends.reference import ReferenceOps  # noqa: E402
from deepinfer.checkpoint.tiny import TINY_V4  # noqa: E402
from deepinfer.kernels.group_pool import group_pool  # noqa: E402
from deepinfer.models.deepseek_v4.compressor import Compressor  # noqa: E402
from deepinfer.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from deepinfer.models.deepseek_v4.layers import RotaryTable  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (real sizes)")
KERNEL = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")


def group_pool_reference(kv, score, cur, prev, has_prev, live, d):
    """The torch definition the kernel replaces: ``ReferenceOps.group_pool``."""
    return ReferenceOps().group_pool(kv, score, cur, prev, has_prev, live, d)


def _ring(s, m, d, overlap, cap, seed, device=DEVICE, slots=None):
    """Arguments of ``group_pool`` for ``s`` rows over ring buffers of ``slots`` slots of ``cap`` rows: row ``i``
    in slot ``slot[i]`` (slots repeat) at position ``pos[i]``, its group ``w = pos // m`` (clamped as the decode step
    clamps it) wrapping around the ring; about half the rows have a previous group and are live; scores of many
    magnitudes with some ``-inf`` (never a whole channel of a row)."""
    g = torch.Generator().manual_seed(seed)
    slots = slots or max(2, s // 2)
    c = 2 * d if overlap else d
    n = slots * cap
    kv = torch.randn(n, c, generator=g) * torch.logspace(-2, 3, n).unsqueeze(1)[torch.randperm(n, generator=g)]
    score = (
        torch.randn(n, c, generator=g) * torch.tensor([1.0, 10.0, 100.0, 1e4])[torch.randint(4, (n, 1), generator=g)]
    )
    score += torch.randn(n, 1, generator=g) * 50  # per-row offsets: large differences between a group's rows
    slot = torch.randint(slots, (s,), generator=g)
    pos = torch.randint(0, 6 * cap, (s,), generator=g)
    w = (pos // m).clamp_min(0)
    j = torch.arange(m)
    base = (slot * cap).unsqueeze(1)
    floor = torch.randint(0, 2 * m, (s, 1), generator=g)  # a replay's window start: positions below it repeat
    cur = base + torch.maximum(w.unsqueeze(1) * m + j, floor) % cap
    prev = base + torch.maximum((w.unsqueeze(1) - 1) * m + j, floor) % cap if overlap else None
    inf = torch.rand(n, c, generator=g) < 0.1
    inf[cur[:, -1]] = False  # every group's last current row keeps its scores: no all -inf channel
    score[inf] = float("-inf")
    has_prev = torch.rand(s, generator=g) < 0.6
    live = torch.rand(s, generator=g) < 0.6
    live[0] = has_prev[0] = True
    live[-1], has_prev[-1] = True, False
    args = kv, score, cur, prev, has_prev, live
    return tuple(a.to(device) if a is not None else None for a in args) + (d,)


def _close(got, ref, live):
    got, ref = got.cpu(), ref.cpu()
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(got[~live.cpu()], torch.zeros_like(got[~live.cpu()]))
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


CASES = [  # overlap, m, d, cap, block_d, block_r
    (True, 4, 8, 12, None, None),
    (True, 4, 40, 16, None, None),  # a partial channel block
    (True, 4, 48, 12, 16, 2),  # three channel blocks, two row chunks per half
    (True, 6, 24, 18, 16, None),  # m not a power of two: padded rows
    (False, 16, 8, 32, None, None),
    (False, 16, 40, 48, 32, None),  # a partial channel block
    (False, 16, 48, 40, 16, 4),  # four row chunks
    (False, 4, 24, 8, None, None),
    (False, 12, 20, 36, 16, 8),  # chunks with padded rows
]


@KERNEL
@pytest.mark.parametrize(("overlap", "m", "d", "cap", "block_d", "block_r"), CASES)
def test_kernel_matches_reference(overlap, m, d, cap, block_d, block_r):
    args = _ring(9, m, d, overlap, cap, seed=m * 100 + d)
    ref = group_pool_reference(*args)
    got = group_pool(*args, block_d=block_d, block_r=block_r)
    _close(got, ref, args[5])


@KERNEL
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's -inf - -inf
def test_strided_inputs_and_all_inf_channel():
    """Strided ring views and index tensors are read in place; a channel whose every score is ``-inf`` is NaN in
    both (torch's softmax of all ``-inf``), a row without a previous group is not (its prev rows count as ``-inf``)."""
    kv, score, cur, prev, has_prev, live, d = _ring(5, 4, 16, True, 8, seed=7)
    big_k, big_s = torch.zeros(kv.shape[0], 3 * 32, device=DEVICE), torch.zeros(kv.shape[0], 3 * 32, device=DEVICE)
    kv2, score2 = big_k[:, ::3].copy_(kv), big_s[:, ::3].copy_(score)
    cur2, prev2 = cur.t().contiguous().t(), prev.t().contiguous().t()
    args = kv2, score2, cur2, prev2, has_prev, live, d
    _close(group_pool(*args), group_pool_reference(kv, score, cur, prev, has_prev, live, d), live)
    score2[cur[0], d + 3] = float("-inf")  # row 0's current half of channel 3: every row of its group
    score2[prev[0], 3] = float("-inf")
    score2[cur[-1], d + 5] = float("-inf")  # the last row has no previous group: channel 5 is all -inf too
    ref, got = group_pool_reference(*args), group_pool(*args)
    assert ref[0, 3].isnan() and got[0, 3].isnan() and ref[-1, 5].isnan() and got[-1, 5].isnan()
    ok = ~ref.isnan()
    assert ok.sum() == ref.numel() - 2
    torch.testing.assert_close(got[ok], ref[ok], rtol=1e-6, atol=1e-6 * ref[ok].abs().max().item())


@KERNEL
def test_no_live_rows_and_empty():
    kv, score, cur, prev, has_prev, live, d = _ring(4, 4, 8, True, 8, seed=3)
    kv.fill_(float("nan"))  # never read for a row that is not live
    dead = torch.zeros_like(live)
    assert torch.equal(group_pool(kv, score, cur, prev, has_prev, dead, d).cpu(), torch.zeros(4, d))
    assert torch.equal(group_pool_reference(kv, score, cur, prev, has_prev, dead, d).cpu(), torch.zeros(4, d))
    assert group_pool(kv, score, cur[:0], prev[:0], has_prev[:0], live[:0], d).shape == (0, d)


def test_bad_arguments():
    kv, score, cur, prev, has_prev, live, d = _ring(4, 4, 8, True, 8, seed=1, device="cpu")
    bad = {
        "fp32": (kv.double(), score, cur, prev, has_prev, live, d),
        "one shape": (kv, score[:, :8], cur, prev, has_prev, live, d),
        "C = 2d": (kv, score, cur, prev, has_prev, live, 16),
        "C = d": (kv, score, cur, None, has_prev, live, d),
        "cur must be int64": (kv, score, cur.int(), prev, has_prev, live, d),
        "prev must be int64": (kv, score, cur, prev[:2], has_prev, live, d),
        "has_prev must be bool": (kv, score, cur, prev, has_prev.long(), live, d),
        "live must be bool": (kv, score, cur, prev, has_prev, live[:2], d),
        "d must be positive": (kv, score, cur, prev, has_prev, live, 0),
    }
    for match, args in bad.items():
        with pytest.raises(ValueError, match=match):
            group_pool(*args)
    with pytest.raises(ValueError, match="power of two"):
        group_pool(kv, score, cur, prev, has_prev, live, d, block_d=24)


class _Spy(ReferenceOps):
    """Reference ops that keep what ``softmax_pool`` returned."""

    def softmax_pool(self, kv, score):
        self.pooled = super().softmax_pool(kv, score)
        return self.pooled


@pytest.mark.parametrize(("overlap", "ratio"), [(True, 4), (False, 8)])
def test_reference_is_compressor_rows_bit_for_bit(overlap, ratio):
    """``Compressor._rows`` (torch path, ReferenceOps) pools every row what the reference pools, bit for bit: its
    ``softmax_pool`` output on the live rows, and ``rope(norm(·))`` of the reference on them is its result."""
    config = DeepseekV4Config.from_dict(TINY_V4)
    d = config.head_dim
    comp = Compressor(config, ratio, d, overlap=overlap, rotate=False)
    comp.norm.weight.copy_(torch.rand(d, generator=torch.Generator().manual_seed(0)) + 0.5)
    rope = RotaryTable(config.qk_rope_head_dim, config.compress_rope_theta, config.yarn)
    kv, score, cur, prev, has_prev, live, _ = _ring(11, ratio, d, overlap, 3 * ratio, seed=ratio, device="cpu")
    w = torch.arange(11) * 3
    ops = _Spy()
    rows = comp._rows(kv, score, cur, prev if overlap else (cur - ratio).clamp_min(0), has_prev.view(-1, 1, 1), w,
                      rope, ops, torch.float32)  # fmt: skip
    ref = group_pool_reference(kv, score, cur, prev, has_prev, live, d)
    assert torch.equal(ref[live], ops.pooled[live]) and torch.equal(ref[~live], torch.zeros_like(ref[~live]))
    cos, sin = rope(w * ratio, ops)
    again = ops.rope(comp.norm(ref, ops), cos, sin)
    assert torch.equal(again[live], rows[live])


@GPU_ONLY
@pytest.mark.parametrize(("overlap", "m", "d"), [(False, 128, 512), (True, 4, 512)])
def test_real_sizes_on_gpu(overlap, m, d):
    args = _ring(64, m, d, overlap, 2 * m, seed=m, device="cuda", slots=64)
    ref = group_pool_reference(*args)
    got = group_pool(*args)
    assert torch.equal(got[~args[5]], torch.zeros_like(got[~args[5]]))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
