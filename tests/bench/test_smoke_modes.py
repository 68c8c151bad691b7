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
