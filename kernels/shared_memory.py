"""Shared memory a kernel's block may use, and the pipeline stages that fit it.

Tiles are sized for bf16 operands; the same tiles on fp32 operands need twice the memory a stage, and a launch whose
stages do not fit fails (Triton's ``OutOfResources``). ``fit_stages`` takes stages off until they fit.
"""

from __future__ import annotations

# what one block may use on an H100 or H200 (the opt-in limit; an A100 has 166,912 bytes, consumer parts less)
SHARED_MEMORY = 232_448


def fit_stages(stages: int, stage_bytes: int, limit: int = SHARED_MEMORY) -> int:
    """The most of ``stages`` pipeline stages of ``stage_bytes`` each that fit ``limit`` bytes (one at least)."""
    while stages > 1 and stages * stage_bytes > limit:
        stages -= 1
    return stages


__all__ = ["SHARED_MEMORY", "fit_stages"]
