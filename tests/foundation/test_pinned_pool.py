"""The pinned pool (``deepinfer.runtime.pinned_pool``): ranges carved first fit and aligned, returned when the last
view of them is freed, merged with their free neighbours, and a request that does not fit refused (the caller's
fallback), on plain host memory; on a GPU, ``HostCopies`` takes its tensors from the pool."""

import gc

import numpy as np
import pytest
import torch

from deepinfer.runtime import pinned_pool
from deepinfer.runtime.host_copy import HostCopies
from deepinfer.runtime.pinned_pool import ALIGN, PinnedPool


def test_ranges_are_aligned_typed_and_disjoint():
    p = PinnedPool(8 * ALIGN, pinned=False)
    a = p.empty((3, 5), torch.float32)
    b = p.empty((7,), torch.int64)
    c = p.empty((), torch.bfloat16)
    assert a.shape == (3, 5) and a.dtype == torch.float32 and b.shape == (7,) and c.shape == ()
    ptrs = sorted(t.data_ptr() - p.slab.data_ptr() for t in (a, b, c))
    assert ptrs == [0, ALIGN, 2 * ALIGN]  # first fit, each its own aligned range
    a.fill_(1.5), b.fill_(-3), c.fill_(2.0)
    assert a.sum().item() == 22.5 and b.sum().item() == -21 and c.item() == 2.0  # none overwrote another
    assert p.in_use == 3 * ALIGN and p.free_ranges() == [(3 * ALIGN, 5 * ALIGN)]


def test_a_range_returns_when_its_last_view_is_freed_and_merges_with_its_neighbours():
    p = PinnedPool(4 * ALIGN, pinned=False)
    a, b, c = (p.empty((ALIGN // 4,), torch.float32) for _ in range(3))
    arr = b.numpy()  # a view of b's range that outlives the tensor
    del b
    gc.collect()
    assert p.free_ranges() == [(3 * ALIGN, ALIGN)]  # still held by the array
    arr[:] = 7.0
    del arr, a
    gc.collect()
    assert p.free_ranges() == [(0, 2 * ALIGN), (3 * ALIGN, ALIGN)]  # a and b merged; c still in use
    del c
    gc.collect()
    assert p.free_ranges() == [(0, 4 * ALIGN)] and p.in_use == 0 and p.peak == 3 * ALIGN


def test_a_request_that_fits_no_free_range_is_refused_and_counted():
    p = PinnedPool(4 * ALIGN, pinned=False)
    keep = [p.empty((ALIGN,), torch.uint8) for _ in range(4)]
    del keep[1]
    gc.collect()
    assert p.empty((ALIGN + 1,), torch.uint8) is None and p.fallbacks == 1  # one range free, too small
    assert p.empty((ALIGN,), torch.uint8) is not None and p.empty((1,), torch.uint8) is None
    assert p.fallbacks == 2 and p.empty((0, 3), torch.float32).shape == (0, 3)  # (empty: no range needed)


def test_ranges_come_and_go_in_any_order_without_losing_memory():
    p = PinnedPool(64 * ALIGN, pinned=False)
    rng = np.random.default_rng(0)
    held = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            held.pop(int(rng.integers(len(held))))
        else:
            t = p.empty((int(rng.integers(1, 3 * ALIGN)),), torch.uint8)
            if t is not None:
                t.fill_(len(held) % 251)
                held.append((t, len(held) % 251))
        assert all(int(t.min()) == v == int(t.max()) for t, v in held)  # no range handed out twice
        free = p.free_ranges()
        assert all(s + n < s2 for (s, n), (s2, _) in zip(free, free[1:]))  # sorted, never adjacent
        assert sum(n for _, n in free) + p.in_use == p.nbytes
    del t
    held.clear()
    assert p.free_ranges() == [(0, 64 * ALIGN)]


def test_no_pool_when_its_setting_is_zero(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DEEPINFER_PINNED_POOL_BYTES", "0")
    monkeypatch.setattr(pinned_pool, "_POOL", None)
    assert pinned_pool.pool() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_take_their_tensors_from_the_pool(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pinned_pool, "_POOL", PinnedPool(1 << 20))
    src = torch.randn(64, 33, device="cuda")
    copy = HostCopies("cuda")
    host = [copy(src), copy(src[:, ::2])]
    copy.done().synchronize()
    assert pinned_pool.pool().in_use == sum(-(-t.nbytes // ALIGN) * ALIGN for t in host) and host[0].is_pinned()
    assert torch.equal(host[0], src.cpu()) and torch.equal(host[1], src[:, ::2].cpu())
    del host
    gc.collect()
    assert pinned_pool.pool().in_use == 0
