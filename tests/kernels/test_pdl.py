"""``kernels.pdl``: when the Triton kernels launch with programmatic dependent launch. The GPU check that it changes
no bit of a decode step is ``test_graphs.test_pdl_launches_change_no_bit``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.kernels import norm, pdl  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    pdl.reset()
    yield
    pdl.reset()


def test_off_in_the_interpreter_and_when_disabled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch() == {} and not pdl.supported()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    pdl.reset()
    assert pdl.launch() == {}


def test_on_from_hopper(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    want = torch.cuda.is_available() and all(
        torch.cuda.get_device_capability(i)[0] >= 9 for i in range(torch.cuda.device_count())
    )
    assert pdl.launch() == ({"PDL": True, "launch_pdl": True} if want else {})
    assert pdl.launch() is pdl.launch()  # decided once


def test_a_bad_value_is_an_error(monkeypatch):
    from deepinfer.envs import EnvError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DEEPINFER_PDL", "maybe")
    with pytest.raises(EnvError, match="DEEPINFER_PDL"):
        pdl.launch()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kernel_launched_with_pdl_computes_the_same(monkeypatch):
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    with_pdl = norm.rms_norm(x, w, 1e-6)
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    pdl.reset()
    assert not pdl.launch()
    assert torch.equal(with_pdl, norm.rms_norm(x, w, 1e-6))
