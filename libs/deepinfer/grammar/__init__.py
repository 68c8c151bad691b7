"""Structured-output grammars: checking and compiling regex, JSON schema, JSON object, EBNF and structural-tag
constraints with xgrammar or llguidance (``DEEPINFER_GRAMMAR_BACKEND``, :mod:`deepinfer.grammar.llg`) against the
model's tokenizer, never in the per-token path.

* :class:`Compiler` compiles in this process (the offline ``LLM``; each compile process of the pool);
* :class:`GrammarClient` asks the grammar service (``python -m services.grammar``; the balancer);
* :func:`check_limits` refuses abusive grammars in milliseconds, before any compile.

The compiled grammar travels as :class:`CompiledGrammar` (xgrammar's ``serialize_json()`` text, or llguidance's
grammar text, as its ``backend`` says); a worker rebuilds it with
``xgrammar.CompiledGrammar.deserialize_json(text, build_tokenizer_info(model_dir))`` or an ``LLMatcher`` over
``build_llg_tokenizer(model_dir)``. Nothing here imports xgrammar, llguidance (or torch) until a compile or a
tokenizer view is needed.
"""

from typing import TYPE_CHECKING

from deepinfer.grammar.compiler import Compiler
from deepinfer.grammar.limits import Limits, check_limits
from deepinfer.grammar.spec import (
    KINDS,
    CompiledGrammar,
    GrammarError,
    GrammarSpec,
    GrammarTimeout,
    GrammarUnavailable,
)
from deepinfer.grammar.vocab import build_tokenizer_info, control_token_ids, tokenizer_fingerprint
from deepinfer.grammar.wire import grammar_from_proto, grammar_to_proto

if TYPE_CHECKING:
    from deepinfer.grammar.client import GrammarClient


def __getattr__(name: str) -> object:
    if name == "GrammarClient":  # imported on use: the offline engine never loads the service's gRPC stubs
        from deepinfer.grammar.client import GrammarClient

        return GrammarClient
    raise AttributeError(name)


__all__ = [
    "KINDS",
    "CompiledGrammar",
    "Compiler",
    "GrammarClient",
    "GrammarError",
    "GrammarSpec",
    "GrammarTimeout",
    "GrammarUnavailable",
    "Limits",
    "build_tokenizer_info",
    "check_limits",
    "control_token_ids",
    "grammar_from_proto",
    "grammar_to_proto",
    "tokenizer_fingerprint",
]
