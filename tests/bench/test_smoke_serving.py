"""The `--tiny --device cpu` smoke mode of every benchmark in bench/serving/ (smoke_support.py says what is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest
from smoke_support import name, run_smoke, scripts


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", scripts("serving"), ids=name)
def test_smoke_mode(script: Path, tmp_path: Path) -> None:
    run_smoke(script, tmp_path)
