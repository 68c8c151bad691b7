"""Where a rendered conversation's turns end, as token positions: the prefix cache keeps resume points there.

A later turn re-renders the history, and DeepSeek-V4's encoding does not reproduce the generated tokens
verbatim (thinking mode drops earlier turns' reasoning: the reply started ``<think>`` and the history
shows ``</think>``), so the longest prefix two turns share reliably ends right after the ``<｜Assistant｜>``
token of each user turn. Those positions are the hints, and so is the end of the system message (the first
``<｜User｜>`` token's position, when a system message comes before it): every conversation that opens with the same
system message shares the state up to there, whoever holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from deepinfer.chat.tokens import ASSISTANT, USER


def turn_boundaries(ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """Positions right after each ``<｜Assistant｜>`` token of ``ids``, and the first ``<｜User｜>`` token's when a
    system message precedes it (module docstring); empty if the tokenizer lacks them."""
    assistant, user = tokenizer.token_to_id(ASSISTANT), tokenizer.token_to_id(USER)
    if assistant is None:
        return []
    first_user = next((i for i, t in enumerate(ids) if t == user), None) if user is not None else None
    system = [first_user] if first_user is not None and first_user > 1 else []  # (position 0 is the BOS)
    return system + [i + 1 for i, t in enumerate(ids) if t == assistant]
