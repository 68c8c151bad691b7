"""OpenAI ``strict`` on response_format json_schema and on tool functions: a schema that breaks OpenAI's strict
rules is refused naming the place (HTTP 400), a strict-conforming one passes; no processes."""

from __future__ import annotations

import pytest

from services.balancer.openai_protocol import ChatCompletionRequest

MSGS = [{"role": "user", "content": "hi"}]
INNER = {"type": "object", "additionalProperties": False, "required": ["c"], "properties": {"c": {"type": "string"}}}
GOOD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": INNER}}  # fmt: skip


def response_format(schema: dict, strict: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def tools(schema: dict, strict: object) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": strict}}]


def to_proto(**body: object) -> None:
    ChatCompletionRequest(messages=MSGS, **body).to_proto("r", 64)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({**GOOD, "additionalProperties": True}, ": /: with strict, 'additionalProperties' must be false"),
        ({**GOOD, "required": ["a"]}, ": /: with strict, 'required' must list every property (missing 'b')"),
        (
            {**GOOD, "properties": {**GOOD["properties"], "b": {"type": "object", "properties": {"c": {}}}}},
            "/properties/b: with strict, 'additionalProperties' must be false",
        ),  # fmt: skip
        ({"anyOf": [GOOD]}, "with strict, the root schema must be an object"),
    ],
)
def test_strict_schemas_that_break_openais_rules_are_refused(schema: dict, named: str) -> None:
    with pytest.raises(ValueError, match="^response_format.json_schema.schema: ") as e:
        to_proto(response_format=response_format(schema, True))
    assert named in str(e.value)
    with pytest.raises(ValueError, match=r"^tools\[0\].function.parameters: ") as e:
        to_proto(tools=tools(schema, True))
    assert named in str(e.value)
    to_proto(response_format=response_format(schema, False))  # not strict: any schema the grammar enforces
    to_proto(tools=tools(schema, False))


def test_strict_conforming_schemas_pass_and_strict_must_be_a_boolean() -> None:
    to_proto(response_format=response_format(GOOD, True))
    to_proto(tools=tools(GOOD, True))
    with pytest.raises(ValueError, match=r"^response_format.json_schema.strict: expected a boolean"):
        to_proto(response_format=response_format(GOOD, "yes"))
    with pytest.raises(ValueError, match=r"^tools\[0\].function.strict: expected a boolean"):
        to_proto(tools=tools(GOOD, 1))
