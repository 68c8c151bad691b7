"""Control-token strings and fixed prompt texts of the DeepSeek-V4 (April release) chat format.

Every string here must be byte-identical to DeepSeek's reference encoder
(`encoding/encoding_dsv4.py` of deepseek-ai/DeepSeek-V4-Flash). Spec: docs/chat_format.md, "Special tokens",
"Reasoning effort", "Quick-instruction tasks and latest_reminder" and "Tools section".
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"

# Quick-instruction task -> the token appended after the message that carries the task
# (docs/chat_format.md, "Quick-instruction tasks and latest_reminder").
TASK_TOKENS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Reasoning-effort levels the April encoder accepts; only "max" renders anything.
REASONING_EFFORTS = (None, "high", "max")
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
    "\n\n"
)

THINKING_MODES = ("chat", "thinking")

RESPONSE_FORMAT_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

# The tools section appended (after "\n\n") to a system or developer message; "{schemas}" is one
# JSON object per line. The text ends with a newline.
TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), \
pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

# DSML markup of an assistant tool-call block (docs/chat_format.md, "Tool calls in DSML").
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke"
PARAMETER_OPEN = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"
# What separates content from the tool-call block, both when rendering and when parsing.
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"
