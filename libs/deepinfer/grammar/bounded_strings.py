"""Length-bounded JSON strings at xgrammar's own speed, without its raw control characters.

xgrammar (0.2.x) turns ``minLength`` / ``maxLength`` into a counted repetition of one character rule,
``<name>_characters{m, n}``, which it compiles fast (a string of at most 64 characters: 14 ms), but that rule is
``[^"\\\r\n]``: it lets the other raw control characters (``\x00``-``\x1f``) through, which JSON forbids inside a
string. The same bound written as a ``pattern`` is enforced right but compiles as an expanded regex (912 ms for
``{0,64}``, seconds for a schema with a few such fields). So a schema (or a structural tag's schemas) with length
bounds is converted to xgrammar's EBNF, each such character rule is narrowed to ``[^\0-\x1f"\\]`` (a character
that needs no escape), and the EBNF is compiled. Every other schema compiles as before.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer.grammar.spec import GrammarError

__all__ = ["compile_bounded", "has_length_bounds", "narrowed"]

_LOOSE = '[^\\"\\\\\\r\\n]'  # xgrammar's character rule of a length-bounded string, as it prints it
_RULE = re.compile(r"^(\w+) ::= \(\(" + re.escape(_LOOSE) + r"\)\)$", re.M)
_SAFE = '(([^\\0-\\x1f\\"\\\\]))'


def has_length_bounds(text: str) -> bool:
    """Whether a JSON schema's (or a structural tag's) text may hold a length-bounded string."""
    return '"maxLength"' in text or '"minLength"' in text


def narrowed(ebnf: str) -> str:
    """``ebnf`` with every length-bounded string's character rule refusing raw control characters;
    :class:`GrammarError` if a loose character rule is left (an xgrammar that prints it otherwise)."""
    fixed = _RULE.sub(lambda m: f"{m.group(1)} ::= {_SAFE}", ebnf)
    if _LOOSE in fixed:
        raise GrammarError("internal: a length-bounded string's characters could not be restricted to valid JSON")
    return fixed


def compile_bounded(compiler: Any, grammar: Any) -> Any:
    """Compile the xgrammar ``Grammar`` of a schema or structural tag with its bounded strings made valid JSON."""
    return compiler.compile_grammar(narrowed(str(grammar)))
