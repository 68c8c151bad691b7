"""Structured outputs under llguidance through the offline API, on the tiny random checkpoint: every output
validates against its schema and ends on EOS, and requests of both backends share a batch.

Finite languages only (random weights): enums, booleans, bounded numbers, strings with maxLength, bounded arrays.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.structured import LocalConstraints

EOS_ID = 1
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
# the schema pass refuses it (a fractional multipleOf, a maxLength beside a format): auto compiles it with llguidance
REFUSED_BY_THE_PASS = {
    "type": "object",
    "properties": {
        "price": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 20},
        "code": {"type": "string", "pattern": "^(a|b)+$", "minLength": 2, "maxLength": 4},
    },
    "required": ["price", "code"],
    "additionalProperties": False,
}
PROMPTS = ["Tell me a long story about a lighthouse keeper. No JSON!", "Write a poem about rain.", "1 2 3"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llg") / "m", seed=0)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=256, page_size=16)


def use_backend(llm: LLM, model_dir, monkeypatch, backend: str) -> None:
    """The offline engine's compiler under ``DEEPINFER_GRAMMAR_BACKEND=backend`` (read when it is built)."""
    monkeypatch.setenv("DEEPINFER_GRAMMAR_BACKEND", backend)
    llm.constraints = LocalConstraints(model_dir, llm.tokenizer)


def so(kind: str, schema: object = None) -> dict:
    return {"schema_type": kind} | ({"schema": schema} if schema is not None else {})


def valid_and_ended(out, schema: dict | None = None) -> object:
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == EOS_ID and EOS_ID not in o.token_ids[:-1], o
    if schema is None:
        return o.text
    value = json.loads(o.text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    return value


def test_llguidance_outputs_validate(llm: LLM, model_dir, monkeypatch) -> None:
    use_backend(llm, model_dir, monkeypatch, "llguidance")
    for params in (
        SamplingParams(temperature=0, max_tokens=200, so_args=so("json_schema", SCHEMA)),
        SamplingParams(temperature=1.0, seed=7, max_tokens=200, so_args=so("json", json.dumps(SCHEMA))),
    ):
        for out in llm.generate(PROMPTS, params):
            value = valid_and_ended(out, SCHEMA)
            assert " " not in out.outputs[0].text.replace(value["title"], "")  # compact: no free whitespace
    regex = r"(red|green|blue)-[0-9]{2,4}"
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, so_args=so("regex", regex))
    for out in llm.generate(PROMPTS, params):
        assert re.fullmatch(regex, valid_and_ended(out))
    out = llm.generate("Say hi.", SamplingParams(temperature=1.0, seed=1, max_tokens=40, so_args=so("json_object")))[0]
    assert out.outputs[0].text.startswith("{")


def test_auto_mixes_both_backends_in_one_batch(llm: LLM, model_dir, monkeypatch) -> None:
    use_backend(llm, model_dir, monkeypatch, "auto")
    grammars = [llm.constraints.for_request(so("json_schema", s), [1]).grammar for s in (SCHEMA, REFUSED_BY_THE_PASS)]
    assert [g.backend for g in grammars] == ["xgrammar", "llguidance"]
    schemas = [SCHEMA, REFUSED_BY_THE_PASS, REFUSED_BY_THE_PASS, SCHEMA]
    params = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=200, so_args=so("json_schema", s))
              for i, s in enumerate(schemas)]  # fmt: skip
    outs = llm.generate([*PROMPTS, "x"], params)
    for out, schema in zip(outs, schemas, strict=True):
        valid_and_ended(out, schema)
    with pytest.raises(ValueError, match=r"/uniqueItems: .*llguidance refuses it too"):
        unique = {"type": "array", "uniqueItems": True}
        llm.generate("x", SamplingParams(max_tokens=5, so_args=so("json_schema", unique)))
