"""DeepSeek-V4 chat encoding: render OpenAI-style requests as prompts, parse completions back.

Byte-exact with DeepSeek's reference V4 encoder (`encoding/encoding_dsv4.py`, DeepSeek-V4-Flash, April
release). Spec: /work/shared/design/CHAT_ENCODING.md.
"""

from deepinfer.chat.completion import parse_completion
from deepinfer.chat.encoding import encode_messages
from deepinfer.chat.turns import turn_boundaries

__all__ = ["encode_messages", "parse_completion", "turn_boundaries"]
