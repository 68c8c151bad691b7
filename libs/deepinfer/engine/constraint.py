"""What a request's sampled tokens obey (``Constraint``): the scheduler, the balancer and the wire carry it without
the worker's matchers (``engine.constraints``), and without torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Constraint:
    """What a request's sampled tokens obey. ``grammar`` is a ``deepinfer.grammar.CompiledGrammar``."""

    grammar: Any = None
    banned_token_ids: tuple[int, ...] = ()
    after_think: bool = False
    reasoning_banned_token_ids: tuple[int, ...] = ()  # masked before "</think>" only


__all__ = ["Constraint"]
