"""The OpenAI request fields that ask for structured output or tool calls, mapped to the wire (no processes)."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer.rpc.convert import sampling_from_proto
from services.balancer.openai_protocol import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def so_of(**body) -> dict | None:
    wire, _ = ChatCompletionRequest(messages=MSGS, **body).to_proto("r", 64)
    return sampling_from_proto(wire.sampling).so_args


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"schema_type": "json_object"}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            {"schema_type": "json_schema", "schema": json.dumps(SCHEMA)},
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"schema_type": "regex", "schema": "[0-9]+"}),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"schema_type": "ebnf", "schema": 'root ::= "a"'}),
        ({"guided_json": SCHEMA}, {"schema_type": "json_schema", "schema": json.dumps(SCHEMA)}),
        ({"so_args": {"schema_type": "regex", "schema": "x"}}, {"schema_type": "regex", "schema": "x"}),
    ],
)
def test_each_field_becomes_so_args(body, expected) -> None:
    assert so_of(**body) == expected


def test_choice_is_an_escaped_alternation() -> None:
    so = so_of(guided_choice=["a.b", "c|d", "(e)"])
    assert so["schema_type"] == "regex"
    for c in ("a.b", "c|d", "(e)"):
        assert re.fullmatch(so["schema"], c)
    assert not re.fullmatch(so["schema"], "axb")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {}}, "response_format"),  # (no type: never taken as text)
        ({"response_format": {"schema": SCHEMA}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"sql": "a"}}, "structured_outputs.sql"),
        ({"guided_choice": []}, "guided_choice"),
        ({"so_args": {"schema_type": "regex"}}, "so_args.schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice.function.name",
        ),  # fmt: skip
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"chat_template_kwargs": {"thinking": True, "documents": []}}, "chat_template_kwargs.documents"),
        ({"messages": [*MSGS, {"role": "assistant", "content": "Once", "prefix": True}]}, "messages[1].prefix"),
        ({"messages": [{"role": "assistant", "function_call": {"name": "f"}}]}, "messages[0].function_call"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0].function"),  # (checked, not rendered)
    ],
)
def test_bad_fields_are_refused_naming_the_field(body, field) -> None:
    with pytest.raises(ValueError) as e:
        ChatCompletionRequest(**{"messages": MSGS, **body}).to_proto("r", 64)
    assert str(e.value).startswith(field), str(e.value)


def test_tool_choice_on_the_wire() -> None:
    def chat(**body):
        return ChatCompletionRequest(messages=MSGS, **body).to_proto("r", 64)[0].chat

    assert (chat().tool_choice, len(chat().tools)) == ("", 0)
    assert (chat(tools=[TOOL]).tool_choice, len(chat(tools=[TOOL]).tools)) == ("auto", 1)
    assert chat(tools=[TOOL], tool_choice="required").tool_choice == "required"
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert (named.tool_choice, named.tool_choice_function) == ("function", "f")
    none = chat(tools=[TOOL], tool_choice="none")
    assert none.tool_choice == "none" and not none.tools  # not rendered; DSML banned by the balancer
    assert not chat(tools=[TOOL]).HasField("parallel_tool_calls")
    assert chat(tools=[TOOL], parallel_tool_calls=False).parallel_tool_calls is False


def test_completions_take_structured_outputs_too() -> None:
    wire = CompletionRequest(prompt="x", structured_outputs={"regex": "[ab]"}).to_proto("r")
    assert sampling_from_proto(wire.sampling).so_args == {"schema_type": "regex", "schema": "[ab]"}


def test_completions_take_response_format() -> None:
    """As vLLM's completions do: the JSON modes of ``response_format`` constrain a completion too."""
    wire = CompletionRequest(prompt="x", response_format={"type": "json_object"}).to_proto("r")
    assert sampling_from_proto(wire.sampling).so_args == {"schema_type": "json_object"}
    plain = CompletionRequest(prompt="x", response_format={"type": "text"}).to_proto("r")
    assert sampling_from_proto(plain.sampling).so_args is None


def test_a_named_function_must_be_one_of_the_tools_on_the_wire_too() -> None:
    """gRPC ``ChatInput``: the balancer refuses a named tool_choice that names none of the request's tools."""
    from deepinfer.v1 import generation_pb2
    from services.balancer.constraints import tool_choice_of as wire_choice

    chat = generation_pb2.ChatInput(tools=[generation_pb2.Tool(name="f")], tool_choice="function")
    chat.tool_choice_function = "f"
    assert wire_choice(chat) == {"type": "function", "function": {"name": "f"}}
    chat.tool_choice_function = "g"
    with pytest.raises(ValueError, match=r"^chat.tool_choice_function: 'g' is not among chat.tools"):
        wire_choice(chat)


def test_what_a_client_echoes_back_in_its_history_is_taken() -> None:
    """An assistant message as a client got it (refusal, annotations, null function_call / audio) renders as the bare
    one."""
    echoed = {"role": "assistant", "content": "Hi", "refusal": None, "annotations": [], "function_call": None,
              "audio": None}  # fmt: skip
    bare = {"role": "assistant", "content": "Hi"}
    got = [ChatCompletionRequest(messages=[*MSGS, m, *MSGS]).to_proto("r", 64)[0].chat for m in (echoed, bare)]
    assert got[0] == got[1]
