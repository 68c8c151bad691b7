"""The suite's files longest first, so that two workers finish together (pytest plugin, loaded by ``conftest.py``).

``--dist loadfile`` gives each worker a whole file at a time, taking the files in collection order, and xdist's own
reorder (most tests first, turned off in ``pyproject.toml``) says nothing about how long a file takes: a file of
three mesh tests can take minutes and, met last, leave the other worker idle that long. Here the files run in the
order of their seconds in ``tests/file_times.json`` (longest first; a file not listed, e.g. a new one, before them
all), so the last files dealt out are the short ones.

Refresh the times after adding or trimming a slow file: ``python -m pytest --record-file-times tests/file_times.json``
(each file's setup, call and teardown seconds summed over its tests, as its worker measured them).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

TIMES = Path(__file__).with_name("file_times.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-times",
        metavar="PATH",
        default=None,
        help="write each test file's seconds (setup, call, teardown summed) to PATH as JSON (tests/file_order.py)",
    )


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def known_times(path: Path = TIMES) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def order(items: list[pytest.Item], times: dict[str, float]) -> None:
    """Sort ``items`` in place: files longest first, an unknown file first of all; a file's tests keep their order."""
    unknown = max(times.values(), default=0.0) + 1.0
    items.sort(key=lambda item: -times.get(file_of(item.nodeid), unknown))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order(items, known_times())


class FileTimes:
    """Sums each file's report durations on the process that receives every report (xdist's controller)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        self.path.write_text(json.dumps({k: round(v, 1) for k, v in ranked}, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-file-times")
    if path and not hasattr(config, "workerinput"):  # (an xdist worker sees only its own files)
        config.pluginmanager.register(FileTimes(Path(path)), "file-times")
