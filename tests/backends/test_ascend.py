"""The Ascend backend, as far as this machine can check it honestly (no NPU, no torch_npu, no CANN here): backend
selection, the refusal where torch_npu is missing (in-process and by the worker service), and op dispatch — with a
stand-in ``torch_npu`` module that implements ``npu_rms_norm`` as Huawei documents it (``y = x / sqrt(mean(x^2) +
eps) * gamma``, returned with the reciprocal RMS), the fused op runs where the backend says it does and gives the
reference's result; every other op is the reference's."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from deepinfer.backends import platform_for
from deepinfer.backends.ascend import AscendOps
from deepinfer.backends.reference import ReferenceOps
from deepinfer.ops import get_ops

ROOT = Path(__file__).resolve().parents[2]


def test_each_accelerator_has_its_device_type() -> None:
    assert platform_for("ascend").device_type == "npu"  # a torch device once torch_npu has registered it
    assert platform_for("nvidia").device(1) == torch.device("cuda", 1)
    assert platform_for("cpu").device() == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        platform_for("tpu")


def test_without_torch_npu_the_backend_refuses_naming_what_is_missing() -> None:
    if "torch_npu" in sys.modules or any(p.name == "torch_npu" for p in map(Path, sys.path) if p.exists()):
        pytest.skip("torch_npu is installed here")
    with pytest.raises(RuntimeError, match=r"needs torch_npu.*deepinfer\[ascend\]"):
        get_ops("ascend")


def test_the_ascend_worker_service_stops_with_the_reason(tmp_path: Path) -> None:
    from deepinfer.checkpoint.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", seed=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    run = subprocess.run(
        [sys.executable, "-m", "services.worker_ascend", "--model", str(model), "--port", "0"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot start" in run.stdout and "torch_npu" in run.stdout and "Traceback" not in run.stderr


class FakeTorchNpu(types.ModuleType):
    """``torch_npu`` as documented, on the CPU: ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``, computed in the
    input's dtype's float32 accumulation as the NPU kernel does; it records each call."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple] = []

    def npu_rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
        self.calls.append(("npu_rms_norm", tuple(x.shape), gamma.dtype, epsilon))
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    return fake


def test_with_torch_npu_the_ascend_ops_are_selected(fake_npu: FakeTorchNpu) -> None:
    ops = get_ops("ascend")
    assert isinstance(ops, AscendOps) and ops.npu is fake_npu and ops.name == "ascend"
    with pytest.raises(RuntimeError, match="BATCH_INVARIANT is not available on the Ascend backend"):
        get_ops("ascend", batch_invariant=True)


def test_no_npu_visible_is_refused(fake_npu: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    with pytest.raises(RuntimeError, match="no NPU is visible"):
        get_ops("ascend")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_runs_the_fused_kernel_and_matches_the_reference(fake_npu: FakeTorchNpu, dtype) -> None:
    ops, ref = get_ops("ascend"), ReferenceOps()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    out = ops.rms_norm(x, w, 1e-6)
    assert fake_npu.calls == [("npu_rms_norm", (5, 3, 64), dtype, 1e-6)]
    expect = ref.rms_norm(x, w, 1e-6)
    err = ((out.float() - expect.float()).norm() / expect.float().norm()).item()
    assert out.dtype == dtype and out.shape == x.shape and err < (1e-6 if dtype == torch.float32 else 1e-2)


def test_ops_without_a_fused_kernel_are_the_references(fake_npu: FakeTorchNpu) -> None:
    ops, ref = get_ops("ascend"), ReferenceOps()
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 32, generator=g), torch.randn(16, 32, generator=g)
    assert torch.equal(ops.linear(x, w), ref.linear(x, w))
    assert torch.equal(ops.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6))  # no gamma: the reference path
    assert fake_npu.calls == []
    fused = {name for name in dir(AscendOps) if getattr(AscendOps, name) is not getattr(ReferenceOps, name, None)}
    assert {n for n in fused if not n.startswith("_")} == {"FROM_REFERENCE", "fused", "rms_norm"}  # the docs: fused
