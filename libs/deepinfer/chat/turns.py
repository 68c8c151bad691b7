"""Where a rendered conversation's turns end, as token positions: the prefix cache keeps resume points there.

A later turn re-renders the history, and DeepSeek-V4's encoding does not reproduce the generated tokens
verbatim (thinking mode drops earlier turns' reasoning: the reply started ``<think>`` and the history
shows ``</think>``), so the longest prefix two turns share reliably ends right after the ``<｜Assistant｜>``
token of each user turn. Those positions are the hints.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from deepinfer.chat.tokens import ASSISTANT


def turn_boundaries(ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """Positions right after each ``<｜Assistant｜>`` token of ``ids`` (empty if the tokenizer lacks it)."""
    assistant = tokenizer.token_to_id(ASSISTANT)
    if assistant is None:
        return []
    return [i + 1 for i, t in enumerate(ids) if t == assistant]
