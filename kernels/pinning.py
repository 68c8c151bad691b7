"""Pinned plans: the fast kernels made batch-invariant by choosing their launch as if every call had ``PLAN_ROWS`` rows.

Each fast kernel picks its path, tiles and split-K on the host from the call's shapes, the number of rows (tokens,
slots, queries) included: a GEMM of one row takes the CUDA-core gemv, of 64 rows the FP8 tensor cores; a decode-sized
MoE splits K over more pieces than a prefill-sized one; an RMSNorm packs more rows into a program when it has more.
Each of those choices changes the order of a row's sums, so a sequence's logits move with its batch-mates.

Inside :func:`pinned` (the nvidia op set with ``DEEPINFER_BATCH_INVARIANT=1`` runs every op in it) each of those
choices is made from :func:`plan_rows` instead of the call's row count: ``PLAN_ROWS`` whatever the call has, so a
row meets the same binary, the same tiles and the same K order in a batch of 1 and of 256, in a decode step and in
a prefill chunk. Only the number of programs along the rows follows the call. A kernel that cannot run every row
count under one plan (a scratch or counter budget) takes its rows in slices of ``PLAN_ROWS``, each slice the same
launch. Choices made from other sizes (widths, K, the expert count) are left as they are: they are the same for a
row wherever it is computed.

``PLAN_ROWS`` = 64 is the decode batch the fast kernels were tuned hardest for, so a pinned batch of 64 runs as fast
as an unpinned one; smaller batches pay for the wider plan, larger ones (prefill chunks) for the narrower one. Where
a plan made for fewer rows runs 64 rows about as fast and one row much faster, the kernel pins that one instead, one
that still takes any row count up to ``PLAN_ROWS`` in one launch: the FP8 dense GEMM's tiles planned for
``fp8_gemm_config.PINNED_ROWS`` rows (per weight shape where ``PINNED_ROWS_BY_SHAPE`` says), the small fp32 GEMM's
for ``small_gemm.PINNED_ROWS``; the MXFP4 experts pin their split-K (``moe_mxfp4.PINNED_SPLIT``). Each was chosen by
timing its candidates at 1 and 64 rows on a GPU (``bench/kernels/pinned_plans.py``).
These values define results: change one and pinned outputs change (``requires`` in docs/determinism.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

PLAN_ROWS = 64
_PINNED: ContextVar[bool] = ContextVar("deepinfer_pinned_plans", default=False)


def is_pinned() -> bool:
    """Whether this thread's kernel launches are pinned."""
    return _PINNED.get()


@contextlib.contextmanager
def pinned(on: bool = True) -> Iterator[None]:
    """Pin (``on``) the launches made inside, in this thread (a context variable: other threads are not touched)."""
    token = _PINNED.set(on)
    try:
        yield
    finally:
        _PINNED.reset(token)


def plan_rows(rows: int) -> int:
    """The row count a launch's plan is made for: ``PLAN_ROWS`` when pinned, else ``rows``."""
    return PLAN_ROWS if _PINNED.get() else rows


def row_slices(rows: int) -> list[tuple[int, int]]:
    """``[(start, end), …]`` covering ``rows`` in slices of at most ``PLAN_ROWS`` when pinned, else one slice."""
    if not _PINNED.get() or rows <= PLAN_ROWS:
        return [(0, rows)]
    return [(a, min(rows, a + PLAN_ROWS)) for a in range(0, rows, PLAN_ROWS)]


__all__ = ["PLAN_ROWS", "is_pinned", "pinned", "plan_rows", "row_slices"]
