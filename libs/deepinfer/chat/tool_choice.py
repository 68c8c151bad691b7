"""OpenAI `tool_choice` -> what the worker enforces on a DeepSeek-V4 generation.

Spec: docs/chat_format.md, "Tool calls in DSML" (the call syntax) and "Tool choice and where constraints start".
The grammar applies to the text AFTER the reasoning: in thinking mode from the first `</think>` on, in chat mode
from the first generated token (the prompt ends with `</think>`), so it starts where the content starts.

The grammar is an xgrammar structural tag (its JSON text, for `GrammarCompiler.compile_structural_tag`) whose
call block is exactly what `dsml.render_tool_calls` writes (and so what the reference encoder writes and
`parse_completion` parses): `"\n\n<｜DSML｜tool_calls>\n"`; per call `<｜DSML｜invoke name="NAME">\n`, one
`<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>\n` per argument in the schema's property
order (a blank line when there is none), `</｜DSML｜invoke>\n`; then `</｜DSML｜tool_calls>`, and EOS (the stop
token). String values are raw text (`string="true"`): any text without `｜DSML｜`, an enum's / const's strings,
the `pattern` (full match, as xgrammar applies JSON-schema patterns), a regex for the formats date, time,
date-time, uuid and ipv4, or `[^｜]{min,max}` for length limits. Other values are JSON (`string="false"`) for
the parameter's schema, at most one whitespace character in a row (`{"a": [1, 2]}` as the reference renders
it, or compact). A schema that admits strings and other values gets both forms.

xgrammar 0.2.9's builtin `deepseek_v4` structural tag (`get_builtin_structural_tag("deepseek_v4", tools,
tool_choice, reasoning=False)`) has the same block skeleton, but is not used because it accepts output that
`parse_completion` (like DeepSeek's reference parser) rejects:

- Its `deepseek_xml` parameter style allows one optional whitespace character (space, \t, \r, \n) or none
  before, between and after the parameters and around JSON values, instead of exactly one "\n" after each
  parameter: `…</｜DSML｜parameter><｜DSML｜parameter …`, `">\n\t<｜DSML｜parameter` and `"> 3 <` are accepted.
  A random walk through its masks hits these within a few samples.
- "auto": its free text may contain `｜DSML｜` (any DSML markup) and EOS / BOS text, and a block without the
  leading blank line. Here the content excludes those, the only way into the block is
  `"\n\n<｜DSML｜tool_calls>\n"`, at most once, and nothing follows the block.
- JSON values: unbounded whitespace (max_whitespace_cnt None); raw strings: `</｜DSML｜parameter` text is
  allowed inside, where the reference parser ends the value; undeclared parameters (when additionalProperties
  allows them) with names that may repeat a declared one (a duplicate is a parse error).
- tool_choice "none": free text; here no grammar, and the DSML token is banned.

Limits: undeclared properties are never generated (additionalProperties / patternProperties are not used);
a `pattern` that admits "｜", and string length limits inside JSON values, leave `</｜DSML｜parameter` text
possible inside a value (xgrammar drops length limits under a substring exclusion, so the limits win).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from deepinfer.chat.tokens import (
    BOS,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    THINK_END,
    THINK_START,
    THINKING_MODES,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
)

__all__ = ["ToolConstraint", "tool_constraint"]

TOOL_CHOICES = ("none", "auto", "required")
# OpenAI allows [a-zA-Z0-9_-]{1,64}; "." and ":" are accepted too (namespaced tools).
_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_MAX_WHITESPACE = 1  # consecutive whitespace characters inside JSON values


@dataclass(frozen=True)
class ToolConstraint:
    """What the worker enforces on one request's generated text.

    kind / text: the grammar, applied from where the content starts (after `</think>` in thinking mode);
        kind "structural_tag" with `text` the structural tag's JSON, or None / None for no grammar.
    banned_texts: control-token texts never sampled, anywhere in the output (reasoning included).
    reasoning_banned_texts: control-token texts never sampled before `</think>` (thinking mode only): the
        model must close its reasoning before it calls a tool (SGLang's "strict thinking"), so the call falls
        under the grammar. Optional for the worker; the streaming parser copes without it.
    mode: the resolved tool_choice: "none", "auto", "required" or "named".
    """

    kind: str | None
    text: str | None
    banned_texts: tuple[str, ...] = ()
    reasoning_banned_texts: tuple[str, ...] = ()
    mode: str = "auto"


def tool_constraint(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    thinking_mode: str,
    *,
    parallel_tool_calls: bool = True,
) -> ToolConstraint | None:
    """Validate OpenAI `tools` / `tool_choice` and return the constraint on the generation.

    tools: OpenAI tools ({"type": "function", "function": {"name", "description", "parameters"}}); None or [].
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} | None (the
        OpenAI default: "auto" with tools, nothing without).
    thinking_mode: "chat" or "thinking", as the prompt was rendered.
    parallel_tool_calls: False allows at most one call.

    "none": no grammar, the DSML token banned. "auto": free content (no DSML, think tags, BOS/EOS text), then
    optionally one tool-call block of one or more calls. "required": the block with at least one call and no
    content. Named: the block with exactly one call of that function. Arguments follow each tool's schema.
    Returns None for a request without tools and without tool_choice. Raises ValueError naming the field.
    """
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode: expected one of {THINKING_MODES}, got {thinking_mode!r}")
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls: expected a boolean, got {parallel_tool_calls!r}")
    functions = _check_tools(tools)
    mode, named = _check_tool_choice(tool_choice, functions)
    if mode is None:
        return None
    if mode == "none":
        return ToolConstraint(kind=None, text=None, banned_texts=(DSML,), mode="none")
    if mode == "named":
        functions = [f for f in functions if f["name"] == named]
    block = _block(functions, once=mode == "named" or not parallel_tool_calls)
    if mode == "auto":
        content = {"type": "any_text", "excludes": [DSML, THINK_START, THINK_END, BOS, EOS]}
        fmt: dict[str, Any] = {"type": "sequence", "elements": [content, {"type": "optional", "content": block}]}
    else:
        fmt = block
    text = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    reasoning_banned = (DSML,) if thinking_mode == "thinking" else ()
    return ToolConstraint(kind="structural_tag", text=text, reasoning_banned_texts=reasoning_banned, mode=mode)


def _block(functions: list[dict[str, Any]], once: bool) -> dict[str, Any]:
    """The tool-call block with its leading blank line; `once`: exactly one call."""
    tags = [
        {
            "type": "tag",
            "begin": f'{INVOKE_OPEN} name="{f["name"]}">\n',
            "content": _invoke_body(f["parameters"]),
            "end": f"{INVOKE_CLOSE}>\n",
        }
        for f in functions
    ]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": ""}
    calls |= {"at_least_one": True, "stop_after_first": once}
    return _seq(_const(f"\n\n{TOOL_CALLS_OPEN}\n"), calls, _const(TOOL_CALLS_CLOSE))


def _invoke_body(schema: dict[str, Any]) -> dict[str, Any]:
    """The parameters of one invoke, as `render_tool_calls` writes them: one `…</｜DSML｜parameter>\n` line per
    argument, in the schema's property order; with no argument a blank line (or, when the schema has optional
    properties only, no line: the parser takes both)."""
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    lines = []
    for name, sub in properties.items():
        line = _seq(_parameter(name, sub, defs), _const("\n"))
        lines.append(line if name in required else {"type": "optional", "content": line})
    if not lines:
        return _const("\n")
    body = _seq(*lines) if len(lines) > 1 else lines[0]
    return body if required else {"type": "or", "elements": [_const("\n"), body]}


def _parameter(name: str, schema: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """`<｜DSML｜parameter name="NAME" string="true|false">VALUE</｜DSML｜parameter>`: string values as raw text (as
    the encoder writes them), every other value as JSON; a schema that admits both gets both forms."""
    resolved = _resolve(schema, defs)
    if resolved is True or (isinstance(resolved, dict) and not (_TYPING_KEYWORDS & resolved.keys())):
        raws = [_ANY_RAW]  # any value: a raw string, or JSON
    elif isinstance(resolved, dict) and _is_string_schema(resolved):
        raw = _raw_string(resolved)
        if raw is not None:
            return _param_tag(name, "true", raw)
        raws = []
    elif isinstance(resolved, dict):
        branches = []
        types = resolved.get("type")
        if types is None and ("enum" in resolved or "const" in resolved):
            branches.append(resolved)  # a mixed enum: its strings raw, the rest JSON
        if isinstance(types, list) and "string" in types:
            branches.append(resolved | {"type": "string"})
        for key in ("anyOf", "oneOf"):
            if isinstance(resolved.get(key), list):
                branches += [b for b in (_resolve(b, defs) for b in resolved[key]) if isinstance(b, dict)]
        raws = [r for b in branches if _is_string_schema(b, mixed=True) and (r := _raw_string(b)) is not None]
    else:
        raws = []
    tags = [_param_tag(name, "true", raw) for raw in raws]
    tags.append(_param_tag(name, "false", _json_value(schema, defs)))
    return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}


def _param_tag(name: str, flag: str, content: dict[str, Any]) -> dict[str, Any]:
    begin = f'{PARAMETER_OPEN} name="{name}" string="{flag}">'
    return {"type": "tag", "begin": begin, "content": content, "end": PARAMETER_CLOSE}


# Keywords that restrict a value's type; a schema without any accepts everything.
_TYPING_KEYWORDS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref", "if"}
_ANY_RAW = {"type": "any_text", "excludes": [DSML]}
# Raw-text regexes of the string formats that have one (JSON Schema / RFC 3339); other formats are not
# enforced (format is an annotation in JSON Schema unless a validator opts in).
_DATE = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": f"({_OCTET}\\.){{3}}{_OCTET}",
}


def _is_string_schema(schema: dict[str, Any], mixed: bool = False) -> bool:
    """Whether every value `schema` accepts is a string (type "string", or a string enum / const); `mixed`:
    whether some value is (an enum / const with some strings)."""
    if schema.get("type") == "string":
        return True
    if "type" in schema or not ("enum" in schema or "const" in schema):
        return False
    values = [schema["const"]] if "const" in schema else schema["enum"]
    if not isinstance(values, list) or not values:
        return False
    return (any if mixed else all)(isinstance(v, str) for v in values)


def _raw_string(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The raw text of a `string="true"` value for a string schema (an enum's / const's string values, the
    pattern, the format, the length limits), or None when it has no representable value."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        strings = [v for v in dict.fromkeys(v for v in values if isinstance(v, str)) if DSML not in v]
        consts = [_const(v) for v in strings if v]
        if not consts:
            return _const("") if "" in strings else None
        fmt = consts[0] if len(consts) == 1 else {"type": "or", "elements": consts}
        return {"type": "optional", "content": fmt} if "" in strings else fmt
    if isinstance(schema.get("pattern"), str):  # full match, as xgrammar applies JSON-schema patterns
        return {"type": "regex", "pattern": schema["pattern"]}
    if schema.get("format") in _FORMATS:
        return {"type": "regex", "pattern": _FORMATS[schema["format"]]}
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return _ANY_RAW
    if low or high is not None:
        # Code points, as JSON Schema counts; "｜" is excluded so that no DSML tag can appear inside.
        return {"type": "regex", "pattern": f"[^｜]{{{low},{'' if high is None else high}}}"}
    return _ANY_RAW


def _json_value(schema: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """A `string="false"` value: JSON for `schema`, at most one whitespace character in a row."""
    if isinstance(schema, dict) and defs:
        schema = {**defs, **schema}
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": "json",
        "max_whitespace_cnt": _MAX_WHITESPACE,
        # No DSML inside JSON strings either (the reference parser would end the value there); xgrammar
        # drops string length limits under an exclusion, so schemas with limits keep the limits instead.
        "excludes": [] if _has_length_limits(schema) else [DSML],
    }


def _resolve(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with local `$ref`s (`#/$defs/X`, `#/definitions/X`) resolved, for classifying it."""
    for _ in range(8):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        section, _, key = schema["$ref"].removeprefix("#/").partition("/")
        target = defs.get(section, {}).get(key)
        if not isinstance(target, dict):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _seq(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _has_length_limits(schema: Any) -> bool:
    """Whether any subschema sets minLength / maxLength (iterative: schemas may nest deeply)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "minLength" in node or "maxLength" in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


# Validation -------------------------------------------------------------------------------------------------


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    """The function definitions of `tools` as {"name", "parameters"} (parameters defaulted), validated."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools: expected a list, got {type(tools).__name__}")
    functions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: expected an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type: expected 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: expected an object, got {type(function).__name__}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"{where}.function.name: expected 1-128 characters of [A-Za-z0-9_.:-], got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name: duplicate tool name {name!r}")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is None:  # OpenAI: no parameters = an empty parameter list
            parameters = {"type": "object", "properties": {}}
        _check_parameters(parameters, f"{where}.function.parameters")
        functions.append({"name": name, "parameters": parameters})
    return functions


def _check_parameters(schema: Any, where: str) -> None:
    """A tool's parameter schema: an object schema whose property names can sit in `name="…"`."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: expected a JSON schema object, got {type(schema).__name__}")
    try:
        json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not serializable as JSON: {e}") from None
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type: a tool's parameters must be an object schema, got {schema.get('type')!r}")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"{where}.properties: expected an object, got {type(properties).__name__}")
    for key, sub in properties.items():
        if not key or any(c in key for c in '"\n\r\t') or DSML in key:
            raise ValueError(f"{where}.properties: invalid parameter name {key!r}")
        if not isinstance(sub, dict | bool):
            raise ValueError(f"{where}.properties.{key}: expected a schema, got {type(sub).__name__}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required: expected a list of parameter names, got {required!r}")
    extra = schema.get("additionalProperties", False)
    for name in required:
        if name not in properties and extra is False:
            raise ValueError(f"{where}.required: {name!r} is not among the properties")
    if len(set(required)) != len(required):
        raise ValueError(f"{where}.required: duplicate names in {required!r}")


def _check_tool_choice(tool_choice: Any, functions: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """(mode, function name) with mode "none" | "auto" | "required" | "named", or (None, None) for a plain request."""
    if tool_choice is None:
        return ("auto" if functions else None), None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice: expected one of {TOOL_CHOICES} or a named function, got {tool_choice!r}")
        if tool_choice != "none" and not functions:
            raise ValueError(f"tool_choice: {tool_choice!r} needs tools, and the request has none")
        return tool_choice, None
    if not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice: expected a string or an object, got {type(tool_choice).__name__}")
    if tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice.type: expected 'function', got {tool_choice.get('type')!r}")
    function = tool_choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("tool_choice.function.name: expected a function name")
    name = function["name"]
    if name not in {f["name"] for f in functions}:
        raise ValueError(f"tool_choice.function.name: no tool named {name!r}")
    return "named", name
