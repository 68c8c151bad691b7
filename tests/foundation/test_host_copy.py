"""Host-to-device copies that never wait for the GPU (``deepinfer.runtime.host_copy``) and the lazy device copies of a
``ForwardBatch`` built from host lists."""

import pytest
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.runtime.host_copy import HostCopies, StagedCopy, copy_to

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_forward_batch_copies_ids_and_positions_once_when_first_read():
    states = [SequenceState(num_tokens=5), SequenceState(num_tokens=0)]
    chunks = [SeqChunk(states[0], 5, 1, torch.arange(2)), SeqChunk(states[1], 0, 3, torch.arange(2))]
    b = ForwardBatch.build(chunks, [[7], [1, 2, 3]])
    assert b.num_tokens == 4 and b.device == torch.device("cpu")
    assert b._token_ids is None and b._positions is None  # nothing made before it is read
    assert b.host_token_ids.tolist() == [7, 1, 2, 3] and b.host_positions.tolist() == [5, 0, 1, 2]
    assert b.positions.tolist() == [5, 0, 1, 2]
    ids = b.token_ids
    assert ids.tolist() == [7, 1, 2, 3] and b.token_ids is ids  # made together, once
    with pytest.raises(ValueError, match="host_token_ids"):
        ForwardBatch(None, None, chunks)


def test_staged_copy_on_the_host_is_a_plain_copy():
    dst = torch.zeros(3, 4, dtype=torch.long)
    st = StagedCopy(dst)
    st.copy(torch.arange(8).view(2, 4))
    assert dst.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 0, 0, 0]]


def test_host_copies_on_the_host_are_plain_copies():
    src = torch.arange(6.0)
    copy = HostCopies("cpu")
    out = copy(src)
    src.zero_()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and copy.done() is None  # nothing queued to wait for


def test_copy_to_is_always_a_copy():
    src = torch.arange(4)
    out = copy_to(src, "cpu")
    src.zero_()
    assert out.tolist() == [0, 1, 2, 3]


@cuda
def test_host_copies_from_the_gpu_never_wait_and_hold_the_values_they_were_queued_at():
    src = torch.arange(4096.0, device="cuda")
    warm = HostCopies("cuda")
    for t in (src, src[::2] * 2):  # the same shapes once: the allocators' blocks
        warm(t)
    warm.done().synchronize()
    torch.cuda._sleep(200_000_000)  # GPU time queued ahead of the copies
    queued = torch.cuda.Event()
    queued.record()
    copy = HostCopies("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [copy(src), copy(src[::2] * 2)]  # (a strided source too)
        ready = copy.done()
        src.fill_(-1.0)  # later work on the stream: the copies read before it
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not queued.query(), "the host waited for the GPU"
    assert ready is not None and all(o.is_pinned() for o in outs)
    ready.synchronize()
    assert torch.equal(outs[0], torch.arange(4096.0)) and torch.equal(outs[1], torch.arange(0.0, 4096.0, 2) * 2)


@cuda
def test_staged_copy_reuses_its_buffers_and_never_waits():
    dst = torch.zeros(5, 16, dtype=torch.long, device="cuda")
    st = StagedCopy(dst, depth=2)
    for i in range(6):  # an idle GPU: every copy finds a free buffer
        src = torch.full((5, 16), i, dtype=torch.long)
        st.copy(src)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), src)
    assert st.fallbacks == 0
    buf = st.take()  # the host writes a buffer itself (numpy), then queues its copy
    buf[:2] = 42
    st.send(2)
    torch.cuda.synchronize()
    assert (dst[:2] == 42).all() and torch.equal(dst[2:].cpu(), src[2:])
    torch.cuda._sleep(200_000_000)  # GPU time queued ahead: the buffers' copies stay pending
    queued = torch.cuda.Event()
    queued.record()
    srcs = [torch.full((3, 16), 10 + i, dtype=torch.long) for i in range(4)]
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for src in srcs:  # later copies find both buffers busy: fresh pinned memory, and no wait
            st.copy(src)
            outs.append(dst[:3].clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not queued.query(), "the host waited for the GPU"
    assert st.fallbacks == 2
    torch.cuda.synchronize()
    for src, out in zip(srcs, outs):  # each copy landed in order, from its own source
        assert torch.equal(out.cpu(), src)


@cuda
def test_forward_batch_device_is_the_tensors_device():
    """``cuda`` names the current device with its index, as the lazily made tensors report it (models compare it with
    their weights' devices)."""
    chunks = [SeqChunk(SequenceState(num_tokens=0), 0, 2, torch.arange(2))]
    b = ForwardBatch.build(chunks, [[3, 4]], "cuda")
    assert b.device == b.token_ids.device == torch.ones(1, device="cuda").device
