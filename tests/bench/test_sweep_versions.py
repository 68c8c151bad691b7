"""``bench/harness.py``'s record of what ran (every result's ``versions``, the sweep's among them): the library's
source hash (the device's copy of ``.git`` may name another commit than the tree that ran)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("harness_under_test", ROOT / "bench" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("harness_under_test", None)


def test_source_hash_follows_names_and_contents(sweep, tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not source\n")
    h = sweep.source_hash(tmp_path)
    assert len(h) == 12 and int(h, 16) >= 0 and sweep.source_hash(tmp_path) == h
    (tmp_path / "notes.txt").write_text("changed\n")
    assert sweep.source_hash(tmp_path) == h  # only Python files count
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    h2 = sweep.source_hash(tmp_path)
    assert h2 != h
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")
    assert sweep.source_hash(tmp_path) != h2  # a renamed file is another tree


def test_versions_carry_the_source_hash(sweep):
    v = sweep.versions()
    assert v["source"] == sweep.source_hash(ROOT / "libs" / "deepinfer") and len(v["source"]) == 12
