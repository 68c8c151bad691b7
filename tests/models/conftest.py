"""Fixtures of the model tests: NeMo AutoModel as the V4.1 reference (installed once, see nemo_reference)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def nemo():
    """NeMo's ``deepseek_v41`` (config, engram) modules; fails loudly when NeMo cannot be installed."""
    from models.nemo_reference import NemoUnavailable, v41_modules

    try:
        config, engram = v41_modules()
    except NemoUnavailable as e:
        pytest.fail(f"the V4.1 parity tests need NeMo AutoModel 0.7.0: {e}", pytrace=False)
    return {"config": config, "engram": engram}
