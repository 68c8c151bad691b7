"""The llguidance backend: compiling a constraint to llguidance's grammar text, and its tokenizer.

=================  =====================================================================================
kind               llguidance call (then ``LLMatcher.validate_grammar`` against the tokenizer, with the limits)
=================  =====================================================================================
``json_schema``    ``grammar_from_json_schema(text, overrides=<options>)``: the schema as written, no pass
``json_object``    ``grammar_from_json_schema('{"type":"object"}', overrides=<options>)``: any object
``regex``          ``grammar_from_regex(text)``
=================  =====================================================================================

``ebnf`` (xgrammar's GBNF, not llguidance's Lark) and ``structural_tag`` stay on xgrammar.

Strict: the options go in as ``overrides``, after the schema's own ``x-guidance``, so a schema can neither
turn on ``lenient`` (llguidance then ignores the keywords it does not implement) nor ``coerce_one_of``
(``oneOf`` enforced as ``anyOf``), nor change the whitespace. Every keyword llguidance does not implement is
an error ("Unimplemented keys: [...]"), which becomes a :class:`GrammarError` naming it.

Whitespace, as xgrammar's (:func:`deepinfer.grammar.compiler.json_layout`): compact JSON by default
(``whitespace_flexible=False``, separators ``,`` and ``:``), else at most N whitespace characters in a row
(``whitespace_pattern``). llguidance cannot lay JSON out indented (``DEEPINFER_GRAMMAR_JSON_INDENT``).

The grammar text is what crosses processes (:class:`~deepinfer.grammar.spec.CompiledGrammar`); a worker builds
an ``LLMatcher`` from it and its own :func:`build_llg_tokenizer`. In llguidance every added token of the
tokenizer (BOS, EOS, the control tokens) is special: never allowed as text, EOS only where the grammar may end.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from pathlib import Path
from typing import Any

from deepinfer.grammar.spec import GrammarError
from deepinfer.grammar.vocab import EOS_TEXT, stat_key, tokenizer_path, vocab_of

__all__ = [
    "LLG_KINDS",
    "build_llg_tokenizer",
    "llg_compile",
    "llg_json_options",
    "llg_reason",
    "llg_version",
    "parser_limits",
]

LLG_KINDS = frozenset({"json_schema", "json_object", "regex"})
_MAX_MESSAGE = 600
_ITEMS_PER_PROPERTY = 6
_ADVICE = re.compile(r"\s*Enable '\w+' option[^.]*\.?")


@functools.cache
def llg_version() -> str:
    return importlib.metadata.version("llguidance")


def llg_json_options(json_whitespace: int, json_indent: int = 0) -> dict[str, Any]:
    """llguidance's JSON compile options for the whitespace settings (the same layout as xgrammar's)."""
    if json_indent:
        raise GrammarError("llguidance cannot lay JSON out indented (DEEPINFER_GRAMMAR_JSON_INDENT)", "invalid")
    strict = {"lenient": False, "coerce_one_of": False, "item_separator": ",", "key_separator": ":"}
    if json_whitespace == 0:
        return {**strict, "whitespace_flexible": False}
    return {**strict, "whitespace_flexible": True, "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{json_whitespace}}}"}


def parser_limits() -> Any:
    """The parser and lexer limits, the same when compiling and on the worker: llguidance's defaults (which
    bound each mask's work), errors that do not echo the grammar, and rows wide enough for the objects the
    property limit lets through (an optional property takes about 4 items of an Earley row: with llguidance's
    2000, an object of 500 optional properties fails at its first key; 2000 properties take 24 ms a mask)."""
    import llguidance

    from deepinfer import envs

    rows = max(2000, _ITEMS_PER_PROPERTY * envs.DEEPINFER_GRAMMAR_MAX_PROPERTIES)
    return llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=rows)


@functools.lru_cache(maxsize=4)
def _tokenizer(key: tuple[str, int, int]) -> Any:
    import llguidance

    encoded, added = vocab_of(key)
    eos = [i for i, (text, _) in added.items() if text == EOS_TEXT]
    return llguidance.LLTokenizer(
        Path(key[0]).read_text(encoding="utf-8"), n_vocab=len(encoded), eos_token=eos[0] if eos else 1
    )


def build_llg_tokenizer(model_dir: str | Path | None = None) -> Any:
    """llguidance's ``LLTokenizer`` of the tokenizer (cached per file): the vocabulary size and EOS as in
    :func:`~deepinfer.grammar.vocab.build_tokenizer_info`."""
    return _tokenizer(stat_key(tokenizer_path(model_dir)))


def llg_reason(error: GrammarError) -> str:
    """The reason in a refusal of :func:`llg_compile` ("<kind>: llguidance: <why>"), without its prefix."""
    return str(error).split(": llguidance: ", 1)[-1]


def _clean(message: str) -> str:
    """llguidance's message without a parser-state dump or advice to turn on an option (the service sets them)."""
    text = _ADVICE.sub("", " ".join(message.split("\n<state>")[0].split()))
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def llg_compile(kind: str, text: str, options: dict[str, Any], tokenizer: Any) -> str:
    """llguidance's grammar text for ``kind`` / ``text``, validated against ``tokenizer`` within
    :func:`parser_limits`; :class:`GrammarError` ("<kind>: llguidance: <why>") if it refuses."""
    import llguidance

    if kind not in LLG_KINDS:
        raise GrammarError(f"{kind}: not compiled by llguidance (only {', '.join(sorted(LLG_KINDS))})")
    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            schema = text if kind == "json_schema" else '{"type":"object"}'
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        check = llguidance.LLMatcher.validate_grammar_with_warnings
        failed, messages = check(grammar, tokenizer, limits=parser_limits())
    except MemoryError:
        raise GrammarError(f"{kind}: the compile ran out of memory", "crash") from None
    except Exception as e:  # noqa: BLE001 - ValueError for a malformed schema, RuntimeError from the parser
        raise GrammarError(f"{kind}: llguidance: {_clean(str(e)) or type(e).__name__}") from None
    if failed:
        raise GrammarError(f"{kind}: llguidance: {_clean(messages[0] if messages else 'refused')}")
    return grammar
