"""Nothing outside a backend's folder names a vendor's device API: the runtime reaches streams, events, graphs and
pinned copies through the platform object (``deepinfer.runtime.platform``), which each backend implements, so a new
accelerator is a new backend folder and nothing else. Read from the code (docstrings and comments may name them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from deepinfer.runtime.platform import HOST, platform_for, platform_of

ROOT = Path(__file__).resolve().parents[2]
ATTRIBUTES = {"cuda", "is_cuda", "npu", "is_npu"}  # torch.cuda.*, t.is_cuda, torch.npu.* (torch_npu's)
NAMES = {"cuda", "torch_npu"}
DEVICE = re.compile(r"(cuda|npu)(:\d+)?")  # a device string: "cuda", "npu:1"


def vendor_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES:
            what = f".{node.attr}"
        elif isinstance(node, ast.Name) and node.id in NAMES:
            what = node.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DEVICE.fullmatch(node.value):
            what = repr(node.value)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            what = next((m for m in mods if m.split(".")[0] == "torch_npu"), None)
        if what:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")
    return found


def test_no_module_outside_a_backend_names_a_vendor_device_api() -> None:
    backends = ROOT / "libs" / "deepinfer" / "backends"
    paths = [p for top in ("libs/deepinfer", "services") for p in sorted((ROOT / top).rglob("*.py"))]
    paths = [p for p in paths if backends not in p.parents and "v1" not in p.relative_to(ROOT).parts]
    assert len(paths) > 150, "the scan sees the code"
    bad = [hit for p in paths for hit in vendor_names(p)]
    assert not bad, "ask the platform (deepinfer.runtime.platform) instead:\n" + "\n".join(bad)


def test_the_scan_finds_what_it_forbids(tmp_path: Path) -> None:
    """The check above can fail: each form it forbids is found in a planted module."""
    planted = ROOT / "libs" / "deepinfer" / "_planted_vendor_names.py"
    planted.write_text(
        "import torch\nimport torch_npu\n"
        "s = torch.cuda.Stream()\nx = torch.zeros(1).is_cuda\nd = torch.device('npu:1')\ncuda = 1\n"
    )
    try:
        hits = [h.split(": ", 1)[1] for h in vendor_names(planted)]
    finally:
        planted.unlink()
    assert hits.count(".cuda") == 1 and ".is_cuda" in hits and "'npu:1'" in hits and "torch_npu" in hits
    assert "cuda" in hits


def test_platforms_by_name_and_by_device() -> None:
    nvidia, ascend = platform_for("nvidia"), platform_for("ascend")  # neither needs its device to be described
    assert (HOST.name, nvidia.name, ascend.name) == ("cpu", "nvidia", "ascend")
    assert platform_of(torch.device("cpu")) is HOST and platform_of(nvidia.device(0)) is nvidia
    assert ascend.device_type == "npu"  # a torch device only once torch_npu has registered it
    assert platform_of("meta") is HOST  # a device type no backend owns
    assert nvidia.graphs and nvidia.pinned_copies and nvidia.triton
    assert not (HOST.graphs or HOST.pinned_copies or ascend.graphs or ascend.pinned_copies)
    assert not HOST.capturing() and HOST.indexed(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(NotImplementedError, match="no streams"):
        HOST.new_stream(torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        platform_for("tpu")


def test_host_copies_on_the_host_platform_are_plain() -> None:
    from deepinfer.runtime.host_copy import StagedCopy, to_device, to_host

    t = torch.arange(6)
    assert to_device(t, "cpu") is t  # no pinned staging where the platform has none
    host, event = to_host(t)
    assert host is t and event is None
    dst = torch.zeros(8, dtype=torch.long)
    staged = StagedCopy(dst)
    assert staged.take() is None  # no pinned buffers for a host destination
    staged.copy(t)
    assert dst[:6].tolist() == list(range(6)) and dst[6:].tolist() == [0, 0]
