"""Conversions between the grammar types and their protobuf messages (``deepinfer.v1``)."""

from __future__ import annotations

from deepinfer.grammar.spec import CompiledGrammar, GrammarError, GrammarSpec
from deepinfer.v1 import common_pb2

__all__ = ["grammar_from_proto", "grammar_to_proto", "kind_from_proto", "kind_to_proto", "spec_from_proto"]

_SchemaType = common_pb2.StructuredOutput
_TO_PROTO = {
    "regex": _SchemaType.SCHEMA_TYPE_REGEX,
    "json_schema": _SchemaType.SCHEMA_TYPE_JSON_SCHEMA,
    "json_object": _SchemaType.SCHEMA_TYPE_JSON_OBJECT,
    "ebnf": _SchemaType.SCHEMA_TYPE_EBNF,
    "structural_tag": _SchemaType.SCHEMA_TYPE_STRUCTURAL_TAG,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def kind_to_proto(kind: str) -> int:
    """``"json_schema"`` -> ``StructuredOutput.SCHEMA_TYPE_JSON_SCHEMA``; :class:`GrammarError` if unknown."""
    try:
        return _TO_PROTO[kind]
    except KeyError:
        raise GrammarError(f"unknown grammar kind {kind!r}: expected one of {', '.join(_TO_PROTO)}") from None


def kind_from_proto(schema_type: int) -> str:
    """The kind of a ``StructuredOutput.schema_type``; :class:`GrammarError` if unspecified or unknown."""
    try:
        return _FROM_PROTO[schema_type]
    except KeyError:
        raise GrammarError(f"structured_output.schema_type: {schema_type} is not a grammar kind") from None


def spec_from_proto(message: common_pb2.StructuredOutput) -> GrammarSpec:
    kind = kind_from_proto(message.schema_type)
    if kind == "json_object" and message.schema:  # (refused, not dropped: a schema travels as json_schema)
        raise GrammarError("structured_output.schema: json_object takes no schema (use json_schema)")
    return GrammarSpec(kind, message.schema)


def grammar_to_proto(grammar: CompiledGrammar) -> common_pb2.CompiledGrammar:
    return common_pb2.CompiledGrammar(
        compiled_json=grammar.compiled_json,
        cache_key=grammar.cache_key,
        tokenizer_fingerprint=grammar.tokenizer_fingerprint,
        allowed_control_token_ids=list(grammar.allowed_control_token_ids),
        backend=grammar.backend,
    )


def grammar_from_proto(message: common_pb2.CompiledGrammar) -> CompiledGrammar:
    return CompiledGrammar(
        message.compiled_json,
        message.cache_key,
        message.tokenizer_fingerprint,
        tuple(message.allowed_control_token_ids),
        message.backend or "xgrammar",
    )
