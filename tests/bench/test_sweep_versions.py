"""``bench/harness.py``'s record of what ran (every result's ``versions``, the sweep's among them): the library's
source hash (the device's copy of ``.git`` may name another commit than the tree that ran)."""

from pathlib import Path

from bench import harness

ROOT = Path(__file__).resolve().parents[2]


def test_source_hash_follows_names_and_contents(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not source\n")
    h = harness.source_hash(tmp_path)
    assert len(h) == 12 and int(h, 16) >= 0 and harness.source_hash(tmp_path) == h
    (tmp_path / "notes.txt").write_text("changed\n")
    assert harness.source_hash(tmp_path) == h  # only Python files count
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    h2 = harness.source_hash(tmp_path)
    assert h2 != h
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")
    assert harness.source_hash(tmp_path) != h2  # a renamed file is another tree


def test_versions_carry_the_source_hash():
    v = harness.versions()
    assert v["source"] == harness.source_hash(ROOT / "libs" / "deepinfer", ROOT / "kernels") and len(v["source"]) == 12
