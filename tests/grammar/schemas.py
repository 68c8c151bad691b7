"""Abusive and slow grammars shared by the grammar tests (built as text: ``json.dumps`` recurses)."""

from __future__ import annotations

import json


def nested_objects(levels: int) -> str:
    """A schema nesting ``levels`` objects (JSON depth 2 * levels + 1)."""
    text = '{"type":"integer"}'
    for _ in range(levels):
        text = '{"type":"object","properties":{"a":' + text + "}}"
    return text


def nested_arrays(levels: int) -> str:
    """A schema nesting ``levels`` arrays (JSON depth levels + 1)."""
    return '{"type":"array","items":' * levels + '{"type":"integer"}' + "}" * levels


def many_optional_properties(n: int) -> str:
    """One object with ``n`` optional string properties: xgrammar takes seconds from about 1000 on."""
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})
