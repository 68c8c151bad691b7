"""A graph capture that fails leaves the device's default random generator usable.

``capture_begin`` marks the device's default generator as capturing; ``capture_end`` clears the mark, but when the
capture failed (an op that cannot be captured, here a host sync) ``capture_end`` raises before it does, and every
later random op on the device fails with "Offset increment outside graph capture encountered unexpectedly". The
decode and prefill graphs fall back to eager steps after such a failure, so sampling must still work then:
``Platform.rng_snapshot`` / ``rng_restore`` undo the mark.
"""

from types import SimpleNamespace

import pytest
import torch

from deepinfer.runtime.decode_graphs import SegmentGraphs
from deepinfer.runtime.platform import platform_of

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _random_then_sync(out: torch.Tensor) -> None:
    out.copy_(torch.rand(out.shape, device=out.device))  # a random op inside the capture
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # not allowed while capturing: the capture fails


@gpu_only
def test_a_failed_capture_marks_the_generator_until_restored():
    dev = _device()
    platform = platform_of(dev)
    snapshot = platform.rng_snapshot(dev)
    out = torch.zeros(8, device=dev)
    graph, side = platform.graph(), platform.new_stream(dev)
    side.wait_stream(platform.current_stream(dev))
    try:
        with pytest.raises(RuntimeError), platform.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _random_then_sync(out)
            finally:
                graph.capture_end()
        with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
            torch.rand(4, device=dev)
    finally:
        platform.rng_restore(snapshot)
    assert torch.rand(4, device=dev).shape == (4,)


class _RandomGraphs(SegmentGraphs):
    """One segment that draws random numbers, then syncs the host while being captured."""

    def _bucket(self, size, device):
        return SimpleNamespace(graphs=[], out=torch.zeros(size, device=device))

    def _segments(self, bk):
        return [lambda: _random_then_sync(bk.out)]


@gpu_only
def test_a_bucket_whose_capture_fails_runs_eagerly_and_sampling_still_works():
    dev = _device()
    graphs = _RandomGraphs(SimpleNamespace(ops=None), max_batch=8)
    assert graphs._capture(4, dev) is None and 4 in graphs.failures
    samples = torch.rand(1000, device=dev)
    assert 0.4 < samples.mean().item() < 0.6
    assert torch.multinomial(torch.ones(4, device=dev), 2).shape == (2,)
