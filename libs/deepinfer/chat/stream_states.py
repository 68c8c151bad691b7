"""The states and markers of the streaming DSML parser (``chat.streaming``): what each state waits for.

Spec: docs/chat_format.md, "Streaming parser" (the state machine) on top of "Tool calls in DSML" and "Parsing
completions" (the DSML grammar).
"""

from __future__ import annotations

import re

from deepinfer.chat.tokens import (
    BOS,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_OPEN,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOL_CALLS_START,
)

# States.
REASONING = "reasoning"
CONTENT = "content"
EXPECT_GT = "expect_gt"  # the ">" that ends `<｜DSML｜tool_calls`, `</｜DSML｜invoke` or `</｜DSML｜parameter`
BLOCK = "block"  # inside `<｜DSML｜tool_calls>`, between invokes
INVOKE_HEADER = "invoke_header"  # after `<｜DSML｜invoke`, up to the first parameter / end of the invoke
INVOKE = "invoke"  # inside an invoke, between parameters
PARAM_HEADER = "param_header"  # after `<｜DSML｜parameter`, up to `string="…">`
VALUE = "value"  # a parameter value, up to `</｜DSML｜parameter`
SKIP_INVOKE = "skip_invoke"  # an invoke without a usable name: dropped up to its end
SKIP_PARAM = "skip_param"  # a parameter that cannot be used: dropped up to its end
AFTER_BLOCK = "after_block"  # after `</｜DSML｜tool_calls>`: only EOS is expected
STRAY = "stray"  # an unknown DSML tag: dropped up to its ">"
DONE = "done"  # after EOS

BLOCK_START_BARE = TOOL_CALLS_OPEN[:-1]  # "<｜DSML｜tool_calls" (no leading blank line)
INVOKE_START = "\n\n" + INVOKE_OPEN  # an invoke without the block wrapper, after a blank line
VALUE_END = f"</{DSML}parameter"
PARAMETER_CLOSE = VALUE_END + ">"
STRAY_LIMIT = 256  # an unknown DSML tag is dropped up to its ">", a newline or this many characters
HEADER_LIMIT = 4096  # an invoke / parameter header longer than this is given up
PIECE = 1024  # feed() takes long texts this many characters at a time

# Same as the reference parser (dsml.py): the invoke header, and a parameter's `string` attribute.
INVOKE_HEADER_RE = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)
LENIENT_NAME_RE = re.compile(r'name="([^"\n]*)"')
PARAM_NAME_PREFIX = ' name="'
PARAM_ATTR_RE = re.compile(r'" string="(true|false)">')
LENIENT_PARAM_RE = re.compile(r'\s*name="([^"\n]*)"\s+string="(true|false)"\s*>')

# Markers of each "between tags" state -> action. At one position the longest marker wins, and a marker
# that could still complete (the buffer ends inside it) holds the text back.
OPENERS = {
    EOS: "eos",
    BOS: "drop",
    THINK_START: "drop",
    DSML: "drop",
    f"<{DSML}": "stray",
    f"</{DSML}": "stray",
    TOOL_CALLS_START: "block",
    BLOCK_START_BARE: "block",
    INVOKE_START: "invoke",
    INVOKE_OPEN: "invoke",
}
TABLES: dict[str, dict[str, str]] = {
    REASONING: {**OPENERS, THINK_END: "end_reasoning"},
    CONTENT: {**OPENERS, THINK_END: "drop"},
    BLOCK: {**OPENERS, THINK_END: "drop", TOOL_CALLS_CLOSE: "block_end"},
    INVOKE: {
        **OPENERS,
        THINK_END: "drop",
        PARAMETER_OPEN: "param",
        INVOKE_CLOSE: "invoke_end",
        TOOL_CALLS_CLOSE: "block_end",
    },
    AFTER_BLOCK: {**OPENERS, THINK_END: "drop"},
    SKIP_INVOKE: {EOS: "eos", INVOKE_CLOSE: "invoke_end", TOOL_CALLS_CLOSE: "block_end", INVOKE_OPEN: "invoke"},
    SKIP_PARAM: {
        EOS: "eos",
        PARAMETER_CLOSE: "param_skipped",
        PARAMETER_OPEN: "param",
        INVOKE_CLOSE: "invoke_end",
        TOOL_CALLS_CLOSE: "block_end",
        INVOKE_OPEN: "invoke",
    },
}
PREFIXES = {
    state: (frozenset(m[:i] for m in table for i in range(1, len(m))), max(map(len, table)))
    for state, table in TABLES.items()
}
_MARKUP = tuple(m for m in OPENERS if DSML in m and "<" in m)  # the openers of DSML tags


def partial_markup(held: str) -> bool:
    """Whether text held back at the end of the generation is DSML markup cut off: it holds `｜DSML｜`, or it
    reaches the `<｜` (or `</｜`) of a DSML tag opener it is a prefix of (a lone `<` or blank line is still text)."""
    return DSML in held or (("<｜" in held or "</｜" in held) and any(m.startswith(held) for m in _MARKUP))


# Where the header of an invoke / parameter certainly ends.
INVOKE_HEADER_ENDS = (PARAMETER_OPEN, INVOKE_CLOSE, EOS, TOOL_CALLS_CLOSE, INVOKE_OPEN)
PARAM_HEADER_ENDS = (f"/{DSML}parameter", EOS, INVOKE_CLOSE, TOOL_CALLS_CLOSE, PARAMETER_OPEN, INVOKE_OPEN)

__all__ = [
    "AFTER_BLOCK",
    "BLOCK",
    "BLOCK_START_BARE",
    "CONTENT",
    "DONE",
    "EXPECT_GT",
    "HEADER_LIMIT",
    "INVOKE",
    "INVOKE_HEADER",
    "INVOKE_HEADER_ENDS",
    "INVOKE_HEADER_RE",
    "LENIENT_NAME_RE",
    "LENIENT_PARAM_RE",
    "PARAM_ATTR_RE",
    "PARAM_HEADER",
    "PARAM_HEADER_ENDS",
    "PARAM_NAME_PREFIX",
    "PIECE",
    "PREFIXES",
    "REASONING",
    "SKIP_INVOKE",
    "SKIP_PARAM",
    "STRAY",
    "STRAY_LIMIT",
    "TABLES",
    "VALUE",
    "VALUE_END",
    "partial_markup",
]
