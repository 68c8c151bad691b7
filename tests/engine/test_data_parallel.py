"""Attention data parallelism in the engine (``engine/data_parallel.py``): where requests go, and what a step is. The
whole engine over ranks in processes of their own, against one process: ``tests/parallel/test_rank_group.py``."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.engine.data_parallel import DataParallelScheduler
from deepinfer.engine.interfaces import RankedPlan, WorkerStepPlan
from deepinfer.engine.scheduler_config import SchedulerConfig


def scheduler_config(max_num_seqs: int) -> SchedulerConfig:
    return SchedulerConfig(page_size=16, max_model_len=512, eos_token_id=1, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=64, prefix_caching=True)  # fmt: skip


def test_placement_goes_to_the_least_loaded_rank() -> None:
    config = scheduler_config(max_num_seqs=8)
    dp = DataParallelScheduler(config, 32, 3)
    dp.add("a", list(range(3, 40)), SamplingParams(max_tokens=4))
    dp.add("b", list(range(3, 20)), SamplingParams(max_tokens=4))
    dp.add("c", list(range(3, 10)), SamplingParams(max_tokens=4))
    assert [dp.rank_of[x] for x in "abc"] == [0, 1, 2]  # each to the least loaded
    dp.add("d", [7, 8], SamplingParams(max_tokens=4))
    assert dp.rank_of["d"] == 2  # the fewest tokens left
    with pytest.raises(ValueError, match="already in use"):
        dp.add("a", [5, 6], SamplingParams(max_tokens=4))


def test_a_step_is_every_ranks_plan_with_the_same_number() -> None:
    config = scheduler_config(max_num_seqs=8)
    dp = DataParallelScheduler(config, 32, 2)
    dp.add("a", list(range(3, 40)), SamplingParams(max_tokens=4))
    plan = dp.schedule()
    assert isinstance(plan, RankedPlan) and [len(p.chunks) for p in plan.ranks] == [1, 0]
    assert plan.chunks == plan.ranks[0].chunks and {p.step_id for p in plan.ranks} == {plan.step_id}
    with pytest.raises(RuntimeError, match="different steps"):
        RankedPlan.of([WorkerStepPlan(1), WorkerStepPlan(2)])


def test_a_rank_with_room_takes_what_another_has_not_started() -> None:
    """One sequence a rank: ``c`` waits on rank 0 behind ``a`` while rank 1's ``b`` ends at its first token; the next
    step rank 1 runs ``c``. A request whose prompt rank 0 holds in its prefix cache stays there."""
    from deepinfer.engine.interfaces import SeqResult, StepResult

    config = scheduler_config(max_num_seqs=1)
    dp = DataParallelScheduler(config, 32, 2)
    dp.add("a", list(range(3, 13)), SamplingParams(max_tokens=20))
    dp.add("b", list(range(3, 33)), SamplingParams(max_tokens=1))
    dp.add("c", list(range(50, 55)), SamplingParams(max_tokens=2))
    assert [dp.rank_of[x] for x in "abc"] == [0, 1, 0]
    plan = dp.schedule()
    assert [[c.request_id for c in p.chunks] for p in plan.ranks] == [["a"], ["b"]]
    dp.update(StepResult(plan.step_id, [SeqResult("a", 7), SeqResult("b", 7)]))
    plan = dp.schedule()
    assert [[c.request_id for c in p.chunks] for p in plan.ranks] == [["a"], ["c"]]
    assert dp.rank_of["c"] == 1 and "c" in dp.ranks[1].requests and "c" not in dp.ranks[0].requests
    dp.update(StepResult(plan.step_id, [SeqResult("a", 7), SeqResult("c", 7)]))
    dp.update(StepResult(dp.schedule().step_id, [SeqResult("a", 7), SeqResult("c", 1)]))  # c ends (eos)
    assert dp.pop_finished("c").output_token_ids == [7, 1]

    # a prompt rank 0 holds (a's, now a resume point there) stays on rank 0 though rank 1 is free
    dp.add("d", list(range(3, 13)) + [9] * 20, SamplingParams(max_tokens=2))
    assert dp.rank_of["d"] == 0  # placed by its prefix
    plan = dp.schedule()
    assert dp.rank_of["d"] == 0 and not plan.ranks[1].chunks
