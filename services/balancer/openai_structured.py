"""OpenAI-side structured output: the request fields that ask for a grammar (``response_format``, vLLM's
``structured_outputs`` and ``guided_*``, DeepInfer's ``so_args``) as one ``so_args``, and ``tool_choice`` as
the wire's (choice, function). Errors are ValueErrors naming the field (HTTP 400)."""

from __future__ import annotations

import re
from typing import Any


def so_args_of(req: Any) -> dict[str, Any] | None:
    """The one structured-output request among the fields that can carry it (two at once: an error)."""
    found: list[tuple[str, dict[str, Any]]] = []
    so = req.structured_outputs or {}
    if not isinstance(so, dict):
        raise ValueError("structured_outputs: expected an object")
    legacy = {"json": req.guided_json, "regex": req.guided_regex, "grammar": req.guided_grammar,
              "choice": req.guided_choice}  # fmt: skip
    for key, value in [(f"structured_outputs.{k}", v) for k, v in so.items()] + [
        (f"guided_{k}", v) for k, v in legacy.items()
    ]:
        if value is None or value is False:
            continue
        kind = key.rsplit(".", 1)[-1].removeprefix("guided_")
        found.append((key, _so_from(kind, value, key)))
    if req.so_args is not None:
        found.append(("so_args", req.so_args))
    rf = getattr(req, "response_format", None)
    if rf is not None:
        so_rf = _response_format(rf)
        if so_rf is not None:
            found.append(("response_format", so_rf))
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one structured-output constraint per request ({found[0][0]} too)")
    return found[0][1] if found else None


def _so_from(kind: str, value: Any, where: str) -> dict[str, Any]:
    """so_args from one vLLM-style field: json (schema object or text), regex, grammar (EBNF), choice, json_object."""
    if kind == "json":
        return {"schema_type": "json_schema", "schema": value}
    if kind == "regex":
        return {"schema_type": "regex", "schema": value}
    if kind == "grammar":
        return {"schema_type": "ebnf", "schema": value}
    if kind == "json_object":
        return {"schema_type": "json_object"}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{where}: expected a non-empty list of non-empty strings")
        return {"schema_type": "regex", "schema": "(" + "|".join(re.escape(c) for c in value) + ")"}
    raise ValueError(f"{where}: unknown structured-output kind (expected json, regex, grammar, choice or json_object)")


def _response_format(rf: Any) -> dict[str, Any] | None:
    """so_args of an OpenAI response_format: text (none), json_object, or json_schema {name, schema, strict}."""
    if not isinstance(rf, dict) or "type" not in rf:
        raise ValueError("response_format: expected an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema_type": "json_object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema: expected {'name': str, 'schema': {...}, 'strict': bool}")
        schema = spec.get("schema")
        if strict_of(spec, "response_format.json_schema"):
            check_strict(schema or {}, "response_format.json_schema.schema")
        return {"schema_type": "json_schema", "schema": schema} if schema else {"schema_type": "json_object"}
    raise ValueError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")


def strict_of(holder: dict, where: str) -> bool:
    """The ``strict`` flag of a json_schema response format or a tool function (absent: false)."""
    strict = holder.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.strict: expected a boolean")
    return bool(strict)


def check_strict(schema: Any, where: str) -> None:
    """OpenAI's rules for a strict schema: the root an object, and every object lists all its properties in
    ``required`` and has ``additionalProperties: false``. A schema that breaks them is refused naming the
    place, as OpenAI does (the grammar enforces any schema it accepts, strict or not)."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(f"{where}: with strict, the root schema must be an object (type 'object')")
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        is_object = node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"])
        if is_object or "properties" in node:
            if node.get("additionalProperties") is not False:
                raise ValueError(f"{where}: {path or '/'}: with strict, 'additionalProperties' must be false")
            props = node.get("properties") or {}
            missing = [k for k in props if k not in (node.get("required") or [])]
            if missing:
                raise ValueError(f"{where}: {path or '/'}: with strict, 'required' must list every property "
                                 f"(missing {', '.join(repr(k) for k in missing[:5])})")  # fmt: skip
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples") and isinstance(value, dict | list):
                stack.append((value, f"{path}/{key}"))


def tool_choice_of(choice: Any, tools: list[str]) -> tuple[str, str]:
    """The wire (tool_choice, tool_choice_function): "" / "auto" / "none" / "required", or ("function", name) of one
    of ``tools`` (the request's function names)."""
    has_tools = bool(tools)
    if choice is None:
        return ("auto" if has_tools else ""), ""
    if choice in ("auto", "none", "required"):
        if choice == "required" and not has_tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return choice, ""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(
            "tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name'}}"
        )
    if not has_tools:
        raise ValueError("tool_choice: a named function needs tools")
    if fn["name"] not in tools:
        raise ValueError(f"tool_choice.function.name: {fn['name']!r} is not among the tools")
    return "function", fn["name"]
