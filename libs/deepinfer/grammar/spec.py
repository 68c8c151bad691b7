"""What a grammar compile takes and gives: :class:`GrammarSpec`, :class:`CompiledGrammar`, the cache key, and the
errors (:class:`GrammarError` and its :class:`GrammarTimeout`, :class:`GrammarUnavailable`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = [
    "BACKENDS",
    "KINDS",
    "OUTCOMES",
    "CompiledGrammar",
    "GrammarError",
    "GrammarSpec",
    "GrammarTimeout",
    "GrammarUnavailable",
    "cache_key",
]

BACKENDS = ("xgrammar", "llguidance")  # what a CompiledGrammar can be; the setting adds "auto"
KINDS = ("regex", "json_schema", "json_object", "ebnf", "structural_tag")
JSON_KINDS = frozenset({"json_schema", "json_object", "structural_tag"})
# How a compile ended (the grammar service's metric label): compiled, refused by xgrammar, refused by the
# limits before compiling, killed past its time limit, its compile process died (or ran out of memory).
OUTCOMES = ("ok", "invalid", "limit", "timeout", "crash")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint to compile: ``kind`` is one of :data:`KINDS`; ``text`` the regex, the JSON schema (JSON
    text), the EBNF grammar or the structural tag (JSON text). For ``json_object`` (any JSON object) the text is
    ``""``: the wire refuses another (``grammar.wire.spec_from_proto``)."""

    kind: str
    text: str


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar as it travels: ``compiled_json`` is xgrammar's ``CompiledGrammar.serialize_json()``
    text (``backend == "xgrammar"``) or llguidance's grammar text, as ``LLMatcher`` takes it (``"llguidance"``);
    then the cache key, the tokenizer it was compiled against, and the control tokens the grammar names (the
    only control tokens a worker may let through under this grammar)."""

    compiled_json: str
    cache_key: str
    tokenizer_fingerprint: str
    allowed_control_token_ids: tuple[int, ...]
    backend: str = "xgrammar"

    @property
    def nbytes(self) -> int:
        """Approximate memory held by this entry (for the byte-capped caches)."""
        return len(self.compiled_json) + len(self.cache_key) + 8 * len(self.allowed_control_token_ids) + 200


class GrammarError(ValueError):
    """The grammar is invalid, over a limit, or could not be compiled; ``str(e)`` says what and why.

    ``outcome`` is one of :data:`OUTCOMES` other than ``ok``.
    """

    def __init__(self, message: str, outcome: str = "invalid") -> None:
        super().__init__(message)
        self.outcome = outcome


class GrammarTimeout(GrammarError):
    """The compile ran past its time limit (the gRPC status DEADLINE_EXCEEDED)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "timeout")


class GrammarUnavailable(RuntimeError):
    """No grammar could be compiled because the compiler is not there: the service is down or unreachable,
    its compile processes cannot start, or it compiles for another tokenizer."""


def cache_key(tokenizer_fingerprint: str, kind: str, text: str, options: str = "") -> str:
    """sha256 over (tokenizer fingerprint, kind, text, compile options), each part length-prefixed."""
    h = hashlib.sha256()
    for part in (tokenizer_fingerprint, kind, text, options):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
