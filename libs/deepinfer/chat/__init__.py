"""DeepSeek-V4 chat encoding: render OpenAI-style requests as prompts, parse completions back.

Byte-exact with DeepSeek's reference V4 encoder (`encoding/encoding_dsv4.py`, DeepSeek-V4-Flash, April
release). Spec: docs/chat_format.md.
"""

from deepinfer.chat.completion import parse_completion
from deepinfer.chat.encoding import encode_messages
from deepinfer.chat.streaming import StreamingParser, merge_deltas
from deepinfer.chat.tool_choice import ToolConstraint, tool_constraint
from deepinfer.chat.turns import turn_boundaries

__all__ = [
    "StreamingParser",
    "ToolConstraint",
    "encode_messages",
    "merge_deltas",
    "parse_completion",
    "tool_constraint",
    "turn_boundaries",
]
