"""The benchmarks are found by subject, and every one of them has a smoke test (test_smoke_<subject>.py)."""

from __future__ import annotations

from smoke_support import BENCH, CHECKS, NO_SMOKE_YET, SCRIPTS, TIMEOUT_S, TRIM, _name

SUBJECTS = ("engine", "host", "kernels", "serving")


def test_scripts_are_found_by_subject():
    names = {_name(p) for p in SCRIPTS}
    assert {"engine/sweep.py", "serving/chaos.py", "kernels/moe_mxfp4.py"} <= names, names
    assert {p.name for p in BENCH.glob("*.py")} == {"harness.py", "figures.py"}  # the tools (test_figures.py)
    assert set(TRIM) | set(CHECKS) | set(TIMEOUT_S) | NO_SMOKE_YET <= names  # no stale entries
    assert {p.relative_to(BENCH).parts[0] for p in SCRIPTS} <= set(SUBJECTS)  # each has its test file


def test_every_script_has_a_row_in_the_bench_readme():
    """bench/README.md's table names every script (what it measures, its peer, its roofline, its latest result)."""
    table = (BENCH / "README.md").read_text()
    missing = [_name(p) for p in SCRIPTS if f"]({_name(p)})" not in table]
    assert not missing, f"bench/README.md has no row for {missing}"
