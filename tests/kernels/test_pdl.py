"""``kernels.pdl``: when the Triton kernels launch with programmatic dependent launch. The GPU check that it changes
no bit of a decode step is ``test_graphs.test_pdl_launches_change_no_bit``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.kernels import norm, pdl  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", pdl.ENABLED)  # as it was, after the test
    pdl.reset()
    yield
    pdl.reset()


def test_off_in_the_interpreter_and_when_disabled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch() == {} and not pdl.supported()
    monkeypatch.delenv("TRITON_INTERPRET")
    pdl.configure(False)
    assert pdl.launch() == {} and not pdl.supported()


def test_on_from_hopper(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl.configure(True)
    want = torch.cuda.is_available() and all(
        torch.cuda.get_device_capability(i)[0] >= 9 for i in range(torch.cuda.device_count())
    )
    assert pdl.launch() == ({"PDL": True, "launch_pdl": True} if want else {})
    assert pdl.launch() is pdl.launch()  # decided once


def test_the_backend_hands_the_setting_over(monkeypatch):
    """``DEEPINFER_PDL`` (the kernels read no settings): the nvidia backend hands it to ``configure``
    (``backends.nvidia.settings.hand_over``), which forgets a decision it changes; a bad value is an error there, on any
    host."""
    from deepinfer.backends.nvidia.settings import hand_over
    from deepinfer.envs import EnvError
    from deepinfer.kernels import attention_wgmma, moe_mxfp4_wgmma

    monkeypatch.setattr(attention_wgmma, "ENABLED", attention_wgmma.ENABLED)  # as they were, after the test
    monkeypatch.setattr(moe_mxfp4_wgmma, "PREFILL", moe_mxfp4_wgmma.PREFILL)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl.configure(True)
    pdl.launch()
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    hand_over()
    assert pdl.ENABLED is False and pdl.launch() == {}
    monkeypatch.delenv("DEEPINFER_PDL")
    hand_over()
    assert pdl.ENABLED is True and pdl.launch() == ({"PDL": True, "launch_pdl": True} if pdl.supported() else {})
    monkeypatch.setenv("DEEPINFER_PDL", "maybe")
    with pytest.raises(EnvError, match="DEEPINFER_PDL"):
        hand_over()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_kernel_launched_with_pdl_computes_the_same(monkeypatch):
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    with_pdl = norm.rms_norm(x, w, 1e-6)
    pdl.configure(False)
    assert not pdl.launch()
    assert torch.equal(with_pdl, norm.rms_norm(x, w, 1e-6))
