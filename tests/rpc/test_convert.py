"""Wire <-> engine conversions keep every field, and bad wire values fail like bad engine values."""

from __future__ import annotations

import pytest

from deepinfer.engine.interfaces import ChunkPlan, SeqResult, StepResult, WorkerStepPlan
from deepinfer.rpc.convert import (
    plan_from_proto,
    plan_to_proto,
    result_from_proto,
    result_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from deepinfer.sampling_params import SamplingParams
from deepinfer.v1 import common_pb2, worker_pb2


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_tokens=5, stop=["\n\n", "END"], stop_token_ids=[7], ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seq_seed=123, logprobs=3, prompt_logprobs=0),
        SamplingParams(min_tokens=2, max_tokens=9, skip_special_tokens=False, include_stop_str_in_output=True),
        SamplingParams(so_args={"schema_type": "regex", "schema": "[a-z]+"}),
        SamplingParams(so_args={"schema_type": "json_schema", "schema": {"type": "object"}}),
        SamplingParams(so_args={"schema_type": "json_object"}),
    ],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    wire = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    back = sampling_from_proto(wire)
    for field in (
        "top_k",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "prompt_logprobs",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "effective_seed",
    ):
        assert getattr(back, field) == getattr(params, field), field
    for field in ("temperature", "top_p", "min_p"):
        assert getattr(back, field) == pytest.approx(getattr(params, field), abs=1e-7), field
    if params.so_args:
        assert back.so_args["schema_type"] == params.so_args["schema_type"]


def test_unset_wire_fields_take_engine_defaults() -> None:
    back = sampling_from_proto(common_pb2.SamplingParams())
    ref = SamplingParams()
    assert (back.temperature, back.top_p, back.max_tokens, back.logprobs, back.effective_seed) == (
        ref.temperature,
        ref.top_p,
        ref.max_tokens,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        (common_pb2.SamplingParams(temperature=-1), "temperature"),
        (common_pb2.SamplingParams(top_p=1.5), "top_p"),
        (common_pb2.SamplingParams(max_tokens=0), "max_tokens"),
        (common_pb2.SamplingParams(logprobs=99), "logprobs"),
        (
            common_pb2.SamplingParams(
                structured_output=common_pb2.StructuredOutput(schema_type=common_pb2.StructuredOutput.SCHEMA_TYPE_REGEX)
            ),
            "so_args",
        ),
        (  # a schema without its type is refused, not dropped
            common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(schema="[ab]+")),
            "so_args.schema",
        ),
        (
            common_pb2.SamplingParams(
                structured_output=common_pb2.StructuredOutput(
                    schema_type=common_pb2.StructuredOutput.SCHEMA_TYPE_JSON_OBJECT, schema='{"type": "integer"}'
                )
            ),
            "so_args.schema",
        ),
    ],
)
def test_bad_wire_values_raise_naming_the_field(wire: common_pb2.SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sampling_from_proto(wire)


def test_step_plan_round_trip_sends_params_once() -> None:
    p1, p2 = SamplingParams(temperature=0), SamplingParams(seed=5, logprobs=1)
    plan = WorkerStepPlan(
        step_id=3,
        chunks=[
            ChunkPlan("a", [1, 2, 3], 0, [4, 5], True, p1, logprob_targets=[2, 3, -1]),
            ChunkPlan("b", [-1], 17, [6], True, p2),
        ],
        released=["z"],
    )
    sent: set[str] = {"z"}
    wire = worker_pb2.StepPlan.FromString(plan_to_proto(plan, sent).SerializeToString())
    assert sent == {"a", "b"} and all(c.HasField("params") for c in wire.chunks)
    known: dict[str, SamplingParams] = {"z": p1}
    back = plan_from_proto(wire, known)
    assert back.step_id == 3 and back.released == ["z"] and "z" not in known
    for a, b in zip(plan.chunks, back.chunks):
        assert (a.request_id, a.token_ids, a.start, a.block_table, a.sample) == (
            b.request_id,
            b.token_ids,
            b.start,
            b.block_table,
            b.sample,
        )
        assert a.logprob_targets == b.logprob_targets
        assert b.params.effective_seed == a.params.effective_seed
    # the next step of the same requests carries no parameters, and the worker still knows them
    nxt = plan_to_proto(WorkerStepPlan(4, [ChunkPlan("a", [9], 3, [4, 5], True, p1)]), sent)
    assert not nxt.chunks[0].HasField("params")
    assert plan_from_proto(nxt, known).chunks[0].params is known["a"]
    with pytest.raises(ValueError, match="params"):
        plan_from_proto(nxt, {})
    assert [c.num_drafts for c in back.chunks] == [0, 0]


def test_step_plan_round_trip_carries_num_drafts() -> None:
    plan = WorkerStepPlan(1, [ChunkPlan("a", [-1], 7, [2], True, SamplingParams(temperature=0), num_drafts=3)])
    wire = worker_pb2.StepPlan.FromString(plan_to_proto(plan, set()).SerializeToString())
    assert wire.chunks[0].num_drafts == 3
    assert plan_from_proto(wire, {}).chunks[0].num_drafts == 3


def test_step_result_round_trip() -> None:
    res = StepResult(
        step_id=9,
        results=[
            SeqResult("a", token_id=11, logprob=-0.25, top_logprobs=[(11, -0.25), (3, -2.5)]),
            SeqResult("b", prompt_logprobs=[{5: -1.5, 2: -0.5}, {7: -3.0}]),
            SeqResult("c", token_id=1, logprob=0.0, error="constraint.grammar: the grammar matcher failed: x"),
        ],
        graph_captures=2,
    )
    back = result_from_proto(worker_pb2.StepResult.FromString(result_to_proto(res).SerializeToString()))
    assert back.step_id == 9 and back.graph_captures == 2
    a, b, c = back.results
    assert a.error is None and b.error is None  # no error: the field stays empty on the wire
    assert c.error == "constraint.grammar: the grammar matcher failed: x" and c.token_id == 1
    assert (a.token_id, a.logprob, a.top_logprobs) == (11, -0.25, [(11, -0.25), (3, -2.5)])
    assert b.token_id is None and b.logprob is None
    assert b.prompt_logprobs == [{5: -1.5, 2: -0.5}, {7: -3.0}]
    assert list(b.prompt_logprobs[0]) == [5, 2]  # the scored token stays first
    assert (a.extra_token_ids, a.extra_logprobs, a.extra_top_logprobs, a.num_drafts) == ([], [], [], 0)


def test_step_result_round_trip_carries_drafts() -> None:
    res = StepResult(
        step_id=2,
        results=[
            SeqResult(
                "a",
                token_id=11,
                logprob=-0.25,
                top_logprobs=[(11, -0.25), (3, -2.5)],
                extra_token_ids=[12, 13],
                extra_logprobs=[-0.5, -0.75],
                extra_top_logprobs=[[(12, -0.5), (4, -1.0)], [(13, -0.75), (5, -1.25)]],
                num_drafts=3,
            ),
            SeqResult(
                "b", 7, -1.0, extra_token_ids=[8], extra_logprobs=[-2.0], extra_top_logprobs=[None], num_drafts=2
            ),
        ],
    )
    back = result_from_proto(worker_pb2.StepResult.FromString(result_to_proto(res).SerializeToString()))
    a, b = back.results
    assert a.token_ids == [11, 12, 13] and a.num_drafts == 3
    assert a.extra_logprobs == [-0.5, -0.75]
    assert a.extra_top_logprobs == [[(12, -0.5), (4, -1.0)], [(13, -0.75), (5, -1.25)]]
    assert (b.token_ids, b.extra_logprobs, b.extra_top_logprobs, b.num_drafts) == ([7, 8], [-2.0], [None], 2)


def test_constraint_travels_with_the_first_chunk_and_again_after_a_release() -> None:
    from deepinfer.engine.constraint import Constraint
    from deepinfer.grammar import CompiledGrammar

    g = CompiledGrammar('{"grammar": 1}', "k" * 64, "f" * 64, (128821, 128822))
    c = Constraint(g, banned_token_ids=(128825,), after_think=True, reasoning_banned_token_ids=(7,))
    p = SamplingParams(so_args={"schema_type": "regex", "schema": "a+"})
    sent: set[str] = set()
    known: dict[str, SamplingParams] = {}
    first = ChunkPlan("r", [1, 2], 0, [0], True, p, constraint=c, constraint_history=[])
    back = plan_from_proto(plan_to_proto(WorkerStepPlan(1, [first]), sent), known).chunks[0]
    assert back.constraint == c and back.constraint_history == []
    later = ChunkPlan("r", [5], 2, [0], True, p)
    assert plan_from_proto(plan_to_proto(WorkerStepPlan(2, [later]), sent), known).chunks[0].constraint is None
    # re-admitted after a preemption: constraint and the tokens generated so far
    again = ChunkPlan("r", [1, 2, 5], 0, [1], True, p, constraint=c, constraint_history=[5])
    wire = plan_to_proto(WorkerStepPlan(3, [again], released=["r"]), sent)
    back = plan_from_proto(wire, known).chunks[0]
    assert back.constraint == c and back.constraint_history == [5]
    bad = worker_pb2.StepPlan(step_id=4)
    chunk = bad.chunks.add(request_id="x", token_ids=[1], sample=True)
    chunk.params.CopyFrom(common_pb2.SamplingParams())
    chunk.constraint.grammar.cache_key = "k"
    with pytest.raises(ValueError, match="constraint.grammar.compiled_json"):
        plan_from_proto(bad, {})


def test_image_chunks_carry_a_flag_and_take_the_workers_prepared_images() -> None:
    """Image features never travel in a step: a chunk that covers an image span is flagged, and the worker gives it
    the images it prepared for the request (PrepareImages); a flagged chunk without them is refused."""
    from deepinfer.engine.multimodal import MultiModalInput, content_digest

    p = SamplingParams(max_tokens=4)
    sched_side = MultiModalInput(((1, 4),), (content_digest(b"png"),), None)
    worker_side = MultiModalInput(((1, 4),), (content_digest(b"png"),), "features")
    plan = WorkerStepPlan(
        1, [ChunkPlan("r", [1, 2, 2], 0, [0], False, p, mm=sched_side), ChunkPlan("s", [7], 0, [1], True, p)]
    )
    wire = plan_to_proto(plan, set())
    assert [c.images for c in wire.chunks] == [True, False]
    assert b"features" not in wire.SerializeToString()
    back = plan_from_proto(wire, {}, {"r": worker_side})
    assert back.chunks[0].mm is worker_side and back.chunks[1].mm is None
    with pytest.raises(ValueError, match=r"chunks.images: no images were prepared for request 'r'"):
        plan_from_proto(wire, {}, {})


def test_plain_decode_rows_come_back_whole() -> None:
    """A decode chunk and a result row with nothing but their token (most of them: converted by a shorter path)
    come back equal to what was sent, field for field, beside rows that carry more."""
    p = SamplingParams(temperature=0)
    plain = ChunkPlan("p", [-1], 40, [1, 2, 3], True, p, num_drafts=2)
    fuller = ChunkPlan("f", [5], 9, [4], True, p, logprob_targets=[1], decoder_from=3, resume_from="s1")
    wire = worker_pb2.StepPlan.FromString(plan_to_proto(WorkerStepPlan(1, [plain, fuller]), set()).SerializeToString())
    back = plan_from_proto(wire, {})
    assert back.chunks[0] == plain
    assert (back.chunks[1].logprob_targets, back.chunks[1].decoder_from, back.chunks[1].resume_from) == ([1], 3, "s1")
    rows = [SeqResult("p", 5, -0.5, num_drafts=1), SeqResult("q", 6, 0.0), SeqResult("t", 7, -1.0, [(7, -1.0)])]
    res = result_from_proto(worker_pb2.StepResult.FromString(result_to_proto(StepResult(2, rows)).SerializeToString()))
    assert res.results == rows
