"""The suite's file order (``tests/file_order.py``): longest files first, new ones before them, each file's tests in
their own order; the committed times name files that exist, and a recorded run writes what its reports took."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import file_order

ROOT = Path(__file__).resolve().parents[2]


def test_files_longest_first_new_files_before_all() -> None:
    items = [SimpleNamespace(nodeid=n) for n in ("a.py::x", "b.py::y", "a.py::z", "c.py::w", "new.py::v")]
    file_order.order(items, {"a.py": 5.0, "b.py": 40.0, "c.py": 12.0})
    assert [i.nodeid for i in items] == ["new.py::v", "b.py::y", "c.py::w", "a.py::x", "a.py::z"]


def test_committed_times_name_existing_files() -> None:
    times = file_order.known_times()
    assert len(times) > 50 and all(v >= 0 for v in times.values())
    missing = [f for f in times if not (ROOT / f).is_file()]
    assert not missing, f"tests/file_times.json names files that are gone (refresh it): {missing}"


def test_recorded_times_sum_each_files_reports(tmp_path: Path) -> None:
    slow = "import time\n\n\ndef test_a():\n    time.sleep(0.3)\n\n\ndef test_b():\n    pass\n"
    (tmp_path / "test_slow.py").write_text(slow)
    (tmp_path / "test_fast.py").write_text("def test_c():\n    pass\n")
    out = tmp_path / "times.json"
    here = str(Path(file_order.__file__).parent)
    conf = f"import sys\nsys.path.insert(0, {here!r})\npytest_plugins = ['file_order']\n"
    (tmp_path / "conftest.py").write_text(conf)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
         f"--record-file-times={out}", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(out.read_text())
    assert list(got) == ["test_slow.py", "test_fast.py"] and got["test_slow.py"] >= 0.3
