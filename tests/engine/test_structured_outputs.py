"""Structured outputs through the offline API on a tiny random DeepSeek-V4 checkpoint.

DeepInfer's "mean" test: the prompts ask for a story and say not to output JSON; the schema forces JSON
anyway. With random weights only grammars with a finite language guarantee termination (enums,
booleans, bounded integers, strings with maxLength, bounded arrays), so those are what is used: the
output must validate and the run must end with a normal stop on EOS.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.chat import parse_completion
from deepinfer.chat.tokens import EOS
from deepinfer.checkpoint.tiny import make_tiny_model

EOS_ID = 1
STORY = [
    [{"role": "system", "content": "You are a novelist. Never output JSON."},
     {"role": "user", "content": "Tell me a long story about a lighthouse keeper. Plain prose only, no JSON!"}],
    [{"role": "user", "content": "Write a poem about rain. Do not use braces or quotes."}],
    [{"role": "user", "content": "Describe your favourite city in three paragraphs."}],
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "genre": {"enum": ["fantasy", "noir", "sci-fi"]},
        "happy_ending": {"type": "boolean"},
        "chapters": {"type": "integer", "minimum": 1, "maximum": 12},
        "title": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["sea", "storm", "light"]}, "maxItems": 3},
    },
    "required": ["genre", "happy_ending", "chapters", "title", "tags"],
    "additionalProperties": False,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_so") / "m", seed=0)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=256, page_size=16)


def so(kind: str, schema: object = None) -> dict:
    return {"schema_type": kind} | ({"schema": schema} if schema is not None else {})


def ended_on_eos(out) -> bool:
    o = out.outputs[0]
    return o.finish_reason == "stop" and o.token_ids[-1] == EOS_ID and EOS_ID not in o.token_ids[:-1]


def test_a_schema_forces_json_on_prompts_that_ask_for_prose(llm: LLM) -> None:
    """The "mean" test, greedy and seeded, schema as an object and as a JSON string."""
    for params in (
        SamplingParams(temperature=0, max_tokens=200, so_args=so("json_schema", SCHEMA)),
        SamplingParams(temperature=1.0, seed=7, max_tokens=200, so_args=so("json", json.dumps(SCHEMA))),
    ):
        outs = llm.chat(STORY, params)
        for out in outs:
            assert ended_on_eos(out), out.outputs[0]
            value = json.loads(out.outputs[0].text)
            jsonschema.validate(value, SCHEMA)
            assert " " not in out.outputs[0].text.replace(value["title"], "")  # compact: no free whitespace


def test_regex_and_ebnf(llm: LLM) -> None:
    regex = r"(red|green|blue)-[0-9]{2,4}"
    ebnf = 'root ::= "(" num op num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= " + " | " * "'
    prompts = ["Tell me about the sea.", "Write a haiku.", "1 2 3"]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=40, so_args=so("regex", regex)))
    for out in outs:
        assert ended_on_eos(out) and re.fullmatch(regex, out.outputs[0].text)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=4, max_tokens=40, so_args=so("ebnf", ebnf)))
    for out in outs:
        assert ended_on_eos(out) and re.fullmatch(r"\((\d|[1-9]\d) [+*] (\d|[1-9]\d)\)", out.outputs[0].text)


def test_json_object_is_a_prefix_of_an_object_or_a_whole_one(llm: LLM) -> None:
    out = llm.generate("Say hi.", SamplingParams(temperature=1.0, seed=1, max_tokens=40, so_args=so("json_object")))[0]
    text = out.outputs[0].text
    assert text.startswith("{")
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert out.outputs[0].finish_reason == "length"


def test_invalid_or_abusive_grammar_raises_before_anything_runs(llm: LLM) -> None:
    deep = '{"type":"object","properties":{"a":' * 500 + '{"type":"integer"}' + "}}" * 500
    cases = [
        so("json_schema", '{"type": "object", "properties": 5}'),
        so("regex", "(unclosed"),
        so("ebnf", "root ::= undefined_rule"),
        so("json_schema", deep),
        so("regex", "a{1000000}"),
    ]
    for args in cases:
        t0 = time.monotonic()
        with pytest.raises(ValueError):
            llm.generate(["fine prompt", "another"], SamplingParams(max_tokens=5, so_args=args))
        assert time.monotonic() - t0 < 1.0, args["schema"][:40]
        assert not llm.engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate("ok", SamplingParams(temperature=0, max_tokens=8, so_args=so("regex", "[a-z]{3}")))[0]
    assert ended_on_eos(out) and re.fullmatch("[a-z]{3}", out.outputs[0].text)


def test_constraints_do_not_leak_into_batch_mates_and_seeded_runs_repeat(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate("The lighthouse", plain)[0].outputs[0].token_ids
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=200, so_args=so("json_schema", SCHEMA))
    first = llm.generate("Story please", seeded)[0].outputs[0].token_ids
    mixed = llm.generate(["The lighthouse", "Story please", "x"], [plain, seeded, seeded])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].token_ids == first


def test_preempted_constrained_requests_resume_their_grammar(model_dir) -> None:
    tight = LLM(model=model_dir, dtype="float32", num_pages=12, page_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, so_args=so("json_schema", SCHEMA))
    outs = tight.chat(STORY * 2, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for out in outs:
        assert ended_on_eos(out)
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_thinking_mode_leaves_the_reasoning_free_and_never_ends_it_with_eos(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=24, so_args=so("regex", "[0-9]{2}"))
    out = llm.chat(STORY[0], params, thinking_mode="thinking")[0]
    ids = out.outputs[0].token_ids
    if 128822 not in ids:  # "</think>" not reached: reasoning only, no EOS, no digits forced
        assert out.outputs[0].finish_reason == "length" and EOS_ID not in ids
        assert not re.fullmatch("[0-9]{2}", out.outputs[0].text)


TOOLS = [
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm",
        "parameters": {"type": "object", "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "label": {"type": "string", "maxLength": 8},
            "loud": {"type": "boolean"},
            "day": {"enum": ["mon", "tue", "wed"]}},
            "required": ["hour", "loud", "day"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "noop", "description": "Do nothing",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip


def test_forced_tool_calls_always_parse_and_validate(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Wake me up on Tuesday at seven."}]
    schema = TOOLS[0]["function"]["parameters"]
    # finite languages: one call (named, or required without parallel calls) — a normal stop every time;
    # required with parallel calls may go on calling (random weights): it stops or runs out of tokens
    cases = [("required", False), ({"type": "function", "function": {"name": "set_alarm"}}, True), ("required", True)]
    for choice, parallel in cases:
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400) for seed in range(2)]
        outs = llm.chat([msgs] * 2, params, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
        for out in outs:
            if choice == "required" and parallel and out.outputs[0].finish_reason == "length":
                continue
            assert ended_on_eos(out), out.outputs[0].text
            parsed = parse_completion(out.outputs[0].text + EOS, "chat")
            calls = parsed["tool_calls"]
            assert calls and parsed["content"] == "" and (parallel or len(calls) == 1)
            for call in calls:
                fn = call["function"]
                args = json.loads(fn["arguments"])
                if isinstance(choice, dict):
                    assert fn["name"] == "set_alarm"
                if fn["name"] == "set_alarm":
                    jsonschema.validate(args, schema)
                else:
                    assert fn["name"] == "noop" and args == {}


def test_tool_choice_none_never_emits_markup(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=40)
    out = llm.chat([{"role": "user", "content": "hi"}], params, tools=TOOLS, tool_choice="none")[0]
    assert 128825 not in out.outputs[0].token_ids  # ｜DSML｜


def test_the_offline_engine_loads_no_grpc_stubs() -> None:
    """The offline ``LLM`` compiles grammars in process: it never imports the grammar service's gRPC stubs (their
    generated code refuses an older grpcio, which an offline user need not have)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, deepinfer.llm, deepinfer.engine.structured, deepinfer.grammar\n"
        "stubs = [m for m in sys.modules if m.endswith('_pb2_grpc')]\n"
        "assert not stubs, stubs\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": "libs:."})
