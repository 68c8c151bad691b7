"""Start-up warm-up of a worker: synthetic requests run through the model runner before it serves, so that the
first real requests do not pay the one-time costs of a batch shape (on the `nvidia` backend: Triton compiling the
kernels of a tile configuration, seconds; capturing a decode CUDA graph per batch bucket, and the piecewise graphs of
the prefill sizes it runs, ``DEEPINFER_PREFILL_GRAPHS``: the factory gives it every token bucket a step may run in).
vLLM captures its graphs at start-up for the same reason: a capture while serving stalls every running request.

``warm_up`` runs, through ``ModelRunner.execute`` like any plan: one prefill chunk of each of ``prefill_tokens`` (one
sequence, clipped to the model length and the pages), then for each decode batch size ``b`` of ``batches``, the
largest first, a step prefilling ``b`` sequences of ``PROMPT`` tokens and ``DECODES`` decode steps of all ``b`` (the
first captures the bucket's graph, the second replays it). With speculative decoding, for each size of
``verify_batches`` one more step verifies ``verifier.max_drafts`` drafts per sequence (``verifier``: the family's
speculator proposing :class:`FixedDrafts`, put in the runner for that step): a verify step of ``b`` sequences replays
the verify step's graphs of ``b`` sequences (DeepSeek-V4's decode-path verify graphs; V4.1's piecewise graphs of ``b
x (drafts + 1)`` tokens), whose capture (seconds on a GPU) a server would otherwise pay the first time the scheduler
drafts for that many sequences at once; then the model's own drafter captures its graphs at that batch (its
``warm_graphs``, where it has them: V4's MTP observe pass and drafting loop). It uses the cache's pages from 0 up,
which no scheduler has handed out yet (it runs before the worker serves; a size that does not fit is skipped), and
releases every state it made: nothing of it is left in the runner, and the pages' contents are overwritten before any
later sequence reads them. The largest batch comes first because a bucket's graph holds the state pool's tensors and
a growing pool drops the graphs captured before (``decode_graphs``); decode steps at a longer context still capture
their span's graph when first met. First of all it reserves the pinned pool (``runtime.pinned_pool``) where the
platform copies through pinned memory, so the first burst of snapshots does not allocate pinned memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from deepinfer.engine.interfaces import ChunkPlan, WorkerStepPlan
from deepinfer.engine.worker import ModelRunner
from deepinfer.runtime import pinned_pool
from deepinfer.runtime.platform import platform_of
from deepinfer.sampling_params import SamplingParams
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

PROMPT = 4  # prompt tokens of each warm-up sequence of a decode batch
DECODES = 2  # decode steps of each batch size (capture, then replay)
PREFIX = "__warmup__"  # request ids: never a client's


class FixedDrafts:
    """The warm-up verify steps' drafter (``engine.speculative.oracle``'s interface): ``counts[b]`` tokens each; their
    values do not matter (the step's shapes do)."""

    def propose(self, rids: list[str], positions: list[int], counts: list[int]) -> list[list[int]]:
        return [[(101 + p + j) % 30000 for j in range(n)] for p, n in zip(positions, counts)]


def decode_sizes(max_num_seqs: int, graph_max_batch: int, buckets: Sequence[int]) -> list[int]:
    """The decode graph buckets a worker may meet: the model's ``buckets`` (``ModelFamily.decode_buckets``) up to
    the smaller of the two limits."""
    top = min(max_num_seqs, graph_max_batch)
    return [b for b in buckets if b <= top]


def _tokens(n: int, vocab: int, salt: int) -> list[int]:
    return [(7919 * (j + salt) + 101) % min(vocab, 30000) for j in range(n)]  # plain text ids of any tokenizer


def warm_up(
    runner: ModelRunner,
    num_pages: int,
    page_size: int,
    max_model_len: int,
    vocab_size: int,
    batches: Sequence[int] = (),
    prefill_tokens: Sequence[int] = (),
    verifier: Any = None,
    verify_batches: Sequence[int] = (),
) -> dict[str, float]:
    """Run the warm-up (module docstring) → seconds per part (``prefill_N``, ``decode_B``, ``verify_B``); skipped
    sizes absent."""
    drafts = verifier.max_drafts if verifier is not None else 0
    params = SamplingParams(temperature=0.0, max_tokens=DECODES + drafts + 2)
    report: dict[str, float] = {}
    if platform_of(runner.device).pinned_copies:  # the pinned pool's slab now, not in the first burst's copies
        t = time.perf_counter()
        if pinned_pool.reserve() is not None:
            report["pinned_pool"] = time.perf_counter() - t
    step = -1

    def run(chunks: list[ChunkPlan]) -> list[int]:
        nonlocal step
        out = runner.execute(WorkerStepPlan(step_id=step, chunks=chunks))
        step -= 1
        return [r.token_id for r in out.results]

    for n in sorted({min(n, max_model_len - 1) for n in prefill_tokens}):
        pages = -(-n // page_size)
        if n < 1 or pages > num_pages:
            continue
        rid, t = f"{PREFIX}prefill-{n}", time.perf_counter()
        try:
            run([ChunkPlan(rid, _tokens(n, vocab_size, n), 0, list(range(pages)), True, params)])
        finally:
            runner.release([rid])
        report[f"prefill_{n}"] = time.perf_counter() - t
    length = PROMPT + DECODES + (drafts + 1 if verify_batches and drafts else 0)
    per_seq = -(-length // page_size)
    for b in sorted(set(batches) | set(verify_batches), reverse=True):  # the largest first: the state pool grows
        if b * per_seq > num_pages or length > max_model_len:  # once, the graphs stay valid
            continue
        rids = [f"{PREFIX}decode-{b}-{i}" for i in range(b)]
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        t = time.perf_counter()
        try:
            last = run([ChunkPlan(r, _tokens(PROMPT, vocab_size, i), 0, tb, True, params)
                        for i, (r, tb) in enumerate(zip(rids, tables))])  # fmt: skip
            for d in range(DECODES):
                last = run(
                    [ChunkPlan(r, [tok], PROMPT + d, tb, True, params) for r, tok, tb in zip(rids, last, tables)]
                )
            report[f"decode_{b}"] = time.perf_counter() - t
            if b in verify_batches and drafts:
                t, spec, runner.spec = time.perf_counter(), runner.spec, verifier
                try:
                    run([ChunkPlan(r, [tok], PROMPT + DECODES, tb, True, params, num_drafts=drafts)
                         for r, tok, tb in zip(rids, last, tables)])  # fmt: skip
                finally:
                    runner.spec = spec
                warm = getattr(spec, "warm_graphs", None)  # the model's own drafter's graphs at this batch
                if warm is not None:
                    warm([runner.states[r] for r in rids])
                report[f"verify_{b}"] = time.perf_counter() - t
        finally:
            runner.release(rids)
            if verifier is not None:
                verifier.release(rids)
    log.info("warmup_done", **{k: round(v, 3) for k, v in report.items()})
    return report


__all__ = ["DECODES", "PROMPT", "FixedDrafts", "decode_sizes", "warm_up"]
