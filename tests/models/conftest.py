"""Fixtures of the model tests: NeMo AutoModel as the V4.1 reference (``deepinfer.checkpoint.references``, installed
once into the checkout's ``.deepinfer/nemo``, which the benchmarks share)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def nemo():
    """NeMo's ``deepseek_v41`` (config, engram) modules; fails loudly when NeMo cannot be installed."""
    from bench.harness import NEMO_DIR
    from deepinfer.checkpoint.references import NemoUnavailable, nemo_v41_modules

    try:
        config, engram = nemo_v41_modules(NEMO_DIR)
    except NemoUnavailable as e:
        pytest.fail(f"the V4.1 parity tests need NeMo AutoModel 0.7.0: {e}", pytrace=False)
    return {"config": config, "engram": engram}
