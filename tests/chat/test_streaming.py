"""The streaming DeepSeek-V4 completion parser: equal to parse_completion on well-formed completions whatever
the chunking (the reference fixtures' assistant turns, hand-written and generated completions), sane on
truncated and malformed ones (no markup in content or reasoning, never raises)."""

import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.chat import StreamingParser, merge_deltas, parse_completion
from deepinfer.chat.dsml import ToolCall, render_tool_calls
from deepinfer.chat.stream_states import partial_markup

DATA = Path(__file__).resolve().parents[1] / "data" / "dsv4_encoding"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
DSML = "｜DSML｜"
FORBIDDEN = (BOS, EOS, "<think>", "</think>", DSML)


def stream(text, mode, cuts=(), finish=True, whole_calls=False):
    """Feed `text` split at `cuts`; return (merged message, parser, raw deltas)."""
    counter = itertools.count()
    parser = StreamingParser(mode, id_factory=lambda: f"call_{next(counter)}", whole_calls=whole_calls)
    bounds = [0, *cuts, len(text)]
    deltas = []
    for a, b in itertools.pairwise(bounds):
        deltas += parser.feed(text[a:b])
    if finish:
        deltas += parser.finish()
    return merge_deltas(deltas), parser, deltas


def comparable(message):
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    return message["reasoning_content"], message["content"], calls


def assert_clean(message):
    for token in FORBIDDEN:
        assert token not in message["content"], message
        assert token not in message["reasoning_content"], message


def assert_equal_everywhere(text, mode, step=1):
    """Every single cut, pairs of cuts, and character by character give parse_completion's result."""
    expected = comparable(parse_completion(text, mode))
    splits = [(i,) for i in range(0, len(text) + 1, step)]
    splits += [(i, j) for i in range(0, len(text), 5) for j in range(i + 1, min(len(text), i + 40), 3)]
    splits.append(tuple(range(1, len(text))))
    for cuts in splits:
        message, parser, _ = stream(text, mode, cuts)
        assert comparable(message) == expected, cuts
        assert not parser.issues, (cuts, parser.issues)
        assert parser.saw_eos == text.endswith(EOS) and not parser.unfinished_call


# ---------------------------------------------------------------------------------------------------------
# Reference fixtures and hand-written completions


def fixture_turns():
    """(completion, mode) of every assistant turn in the reference encoder's gold outputs."""
    turns = []
    for n in range(1, 5):
        gold = (DATA / f"test_output_{n}.txt").read_text()
        for part in gold.split("<｜Assistant｜>")[1:]:
            if EOS not in part:
                continue
            mode = "thinking" if part.startswith("<think>") else "chat"
            body = part.removeprefix("<think>") if mode == "thinking" else part.removeprefix("</think>")
            turns.append((body[: body.index(EOS) + len(EOS)], mode))
    return turns


FIXTURE_TURNS = fixture_turns()


def test_fixture_turns_found():
    assert len(FIXTURE_TURNS) >= 6
    assert any(parse_completion(t, m)["tool_calls"] for t, m in FIXTURE_TURNS)


@pytest.mark.parametrize(("text", "mode"), FIXTURE_TURNS)
def test_fixture_turns_every_split(text, mode):
    assert_equal_everywhere(text, mode, step=1 if len(text) < 400 else 3)


CALLS = [
    ToolCall("get_weather", {"city": 'Pa<ris\n"x" </｜DS', "days": 2, "opts": {"a": [1, 2.5], "b": None}}),
    ToolCall("noargs", {}),
    ToolCall("tag_like", {"q": "a</b>\n\n<｜end", "flag": True, "emoji": "😀 中文 \\ \t"}),
]
HAND = [
    ("Paris weather.</think>\n\n" + render_tool_calls(CALLS) + EOS, "thinking"),
    ("</think>Sure: 2 < 3 and\n\nhere\n\n\n" + render_tool_calls(CALLS[:1]) + EOS, "thinking"),
    ("Plain <b>answer</b> with a\n\n<tool_calls> lookalike and ｜DS｜ bars." + EOS, "chat"),
    ("\n\n" + render_tool_calls(CALLS[1:2]), "chat"),  # no EOS after the block: accepted by the reference
    ("\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>" + EOS, "chat"),  # an empty block
    ("<｜action｜>Search" + EOS, "chat"),  # quick-instruction output
    ("" + EOS, "chat"),
    ("</think>" + EOS, "thinking"),
]


@pytest.mark.parametrize(("text", "mode"), HAND)
def test_hand_written_every_split(text, mode):
    assert_equal_everywhere(text, mode)


def test_delta_shapes():
    text = "r</think>Hi\n\n" + render_tool_calls(CALLS[:2]) + EOS
    _, parser, deltas = stream(text, "thinking", cuts=range(1, len(text)))
    starts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert starts == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "noargs", "arguments": ""}},
    ]
    for delta in deltas:
        assert len(delta) == 1 and list(delta.values())[0]
        if "tool_calls" in delta:
            (entry,) = delta["tool_calls"]
            assert "id" in entry or set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
    assert parser.tool_call_count == 2
    # Fragments of one kind that arrive in one feed are merged.
    _, _, whole = stream(text, "thinking")
    assert [list(d)[0] for d in whole] == ["reasoning_content", "content", "tool_calls", "tool_calls"] + [
        "tool_calls"
    ] * 2


def test_default_ids_unique():
    text = "\n\n" + render_tool_calls([CALLS[1]] * 3) + EOS
    parser = StreamingParser("chat")
    message = merge_deltas(parser.feed(text) + parser.finish())
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 3 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_finish_once_and_feed_after_finish():
    parser = StreamingParser("chat")
    assert parser.feed("a\n\n") == [{"content": "a"}]
    assert parser.finish() == [{"content": "\n\n"}]
    assert parser.finish() == []
    assert parser.feed("more") == [] and parser.malformed


def test_bad_thinking_mode():
    with pytest.raises(ValueError, match="thinking_mode"):
        StreamingParser("think")


# ---------------------------------------------------------------------------------------------------------
# Generated completions (hypothesis)

# Text pieces that look like the start of markup without being markup.
LOOKALIKES = ["<", "</", "\n", "\n\n", "<｜", "｜", "｜DS", "<｜DSML", "</thin", "<thi", "<｜end▁of", "｜DSM", ">", '"']
text_piece = st.one_of(st.text(max_size=6), st.sampled_from(LOOKALIKES))
free_text = st.lists(text_piece, max_size=8).map("".join)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
param_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)
arguments = st.dictionaries(param_name, free_text | json_value, max_size=4)
function_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10)
calls = st.lists(st.builds(ToolCall, function_name, arguments), max_size=3)


def clean(text):
    """`text` without any full control-token string (fragments stay)."""
    while any(token in text for token in FORBIDDEN):
        for token in FORBIDDEN:
            text = text.replace(token, "")
    return text


@st.composite
def completions(draw):
    mode = draw(st.sampled_from(["chat", "thinking"]))
    reasoning = clean(draw(free_text)) + "</think>" if mode == "thinking" else ""
    content = clean(draw(free_text))
    tool_calls = draw(calls)
    # The reference values must not contain the parameter terminator, and content must not end in a way that
    # moves the block opener (content "x\n" + "\n\n<…" is still well-formed: the opener is found first).
    for call in tool_calls:
        for value in call.arguments.values():
            if isinstance(value, str) and f"/{DSML}parameter" in value:
                return draw(st.nothing())
    block = "\n\n" + render_tool_calls(tool_calls) if tool_calls else ""
    return reasoning + content + block + EOS, mode


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completions(), st.randoms(use_true_random=False))
def test_generated_random_splits(completion, rnd):
    text, mode = completion
    expected = comparable(parse_completion(text, mode))
    for _ in range(4):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(0, 12)))) if len(text) > 1 else []
        message, parser, _ = stream(text, mode, cuts)
        assert comparable(message) == expected
        assert not parser.issues, parser.issues
        whole, _, deltas = stream(text, mode, cuts, whole_calls=True)  # each call in one delta, same message
        assert comparable(whole) == expected
        assert sum("tool_calls" in d for d in deltas) == len(expected[2])
        for _, arguments in expected[2]:
            json.loads(arguments)  # string arguments parse back (non-string ones are the generated JSON)


@settings(max_examples=120, deadline=None)
@given(completions(), st.randoms(use_true_random=False))
def test_truncated_generations(completion, rnd):
    """Cut a well-formed completion anywhere (no EOS, as with max_tokens): deltas seen before finish() are
    prefixes of the complete ones; and when the prefix plus EOS is itself well-formed, finish() gives it."""
    text, mode = completion
    full = comparable(parse_completion(text, mode))
    for _ in range(6):
        prefix = text[: rnd.randint(0, len(text) - len(EOS))]
        cuts = sorted(rnd.sample(range(1, len(prefix)), min(len(prefix) - 1, 5))) if len(prefix) > 1 else []
        before, _, _ = stream(prefix, mode, cuts, finish=False)
        reasoning, content, calls_so_far = comparable(before)
        assert full[0].startswith(reasoning) and full[1].startswith(content)
        for (name, args), (full_name, full_args) in zip(calls_so_far, full[2]):
            assert name == full_name and full_args.startswith(args)
        message, parser, _ = stream(prefix, mode, cuts)
        assert_clean(message)
        whole, whole_parser, _ = stream(prefix, mode, cuts, whole_calls=True)
        assert_clean(whole)  # only closed calls, each whole: a prefix of the complete list
        assert (
            comparable(whole)[:2] == comparable(message)[:2]
            and comparable(whole)[2] == full[2][: len(whole["tool_calls"])]
        )
        assert len(whole["tool_calls"]) == len(message["tool_calls"]) - whole_parser.unfinished_call
        try:
            expected = comparable(parse_completion(prefix + EOS, mode))
        except ValueError:
            continue
        # a cut-off start of DSML markup at the end of the text (from its "<｜") is dropped, never released as text;
        # content that only ends with such characters, the text going on after them, keeps them
        tail = (
            i for i in range(len(expected[1])) if partial_markup(expected[1][i:]) and prefix.endswith(expected[1][i:])
        )
        cut = next(tail, len(expected[1]))
        assert comparable(message) == (expected[0], expected[1][:cut], expected[2])
        assert not parser.unfinished_call


def test_text_ending_like_markup_before_tool_calls_is_kept():
    """Content whose last characters could start DSML markup ("<｜"), then blank lines and tool calls: the text went
    on, so those characters are content, cut short or not (a case found by test_truncated_generations)."""
    call = (
        '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n</｜DSML｜invoke>'
    )
    text = f"0000<｜\n\n<｜DSML｜tool_calls>\n{call}\n</｜DSML｜tool_calls>"
    for prefix in (text, text[: text.index("</｜DSML｜tool_calls>")]):
        message, _, _ = stream(prefix, "chat", [5, 9, 30])
        assert message["content"] == "0000<｜"
    assert stream("0000<｜", "chat", [3])[0]["content"] == "0000"  # the text ends there: a cut-off start, dropped


def test_truncated_inside_a_call():
    text = "\n\n" + render_tool_calls([CALLS[0]])
    cut = text.index("Pa<ris") + 3
    message, parser, _ = stream(text[:cut], "chat", cuts=[7, 40])
    assert message["content"] == ""
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa<'}
    assert parser.unfinished_call and not parser.saw_eos and not parser.malformed
    # whole_calls (the HTTP server's mode): the cut call was never sent, a closed one is sent in one delta
    message, parser, deltas = stream(text[:cut], "chat", cuts=[7, 40], whole_calls=True)
    assert message == {"reasoning_content": "", "content": "", "tool_calls": []} and parser.unfinished_call
    text = "Hi\n\n" + render_tool_calls([CALLS[1], CALLS[0]])
    cut = text.index("Pa<ris") + 3
    message, parser, deltas = stream(text[:cut], "chat", cuts=list(range(1, cut)), whole_calls=True)
    assert message["content"] == "Hi" and len(message["tool_calls"]) == 1 and parser.unfinished_call
    assert [d for d in deltas if "tool_calls" in d] == [{"tool_calls": [message["tool_calls"][0] | {"index": 0}]}]


def test_truncated_block_opener_is_dropped():
    for end in ("\n\n<｜DSML｜", "\n\n<｜DSML｜tool_c", "<｜DSML｜invo"):
        message, _, _ = stream("Hello" + end, "chat")
        assert message == {"reasoning_content": "", "content": "Hello", "tool_calls": []}
    for end, content in (("\n\n<｜DS", "Hello"), ("<｜", "Hello"), ("\n</｜DSML｜in", "Hello\n"), ("</｜D", "Hello")):
        message, _, _ = stream("Hello" + end, "chat", cuts=[3, 6])  # cut-off markup from its "<｜": dropped too
        assert message["content"] == content
    # Fragments that never became markup are released.
    message, _, _ = stream("Hello\n\n<", "chat")
    assert message["content"] == "Hello\n\n<"
    message, parser, _ = stream("still thinking\n\n</thi", "thinking")
    assert message["reasoning_content"] == "still thinking\n\n</thi" and parser.in_reasoning


# ---------------------------------------------------------------------------------------------------------
# Malformed output: repaired or degraded, never leaked, never raised

BLOCK = render_tool_calls([ToolCall("f", {"x": 1})])
INVOKE = BLOCK.split("\n", 1)[1].rsplit("\n", 1)[0]  # the invoke alone, without the wrapper


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        # A block before </think>: ends the reasoning (vLLM / Dynamo behaviour).
        ("reason\n\n" + BLOCK + EOS, "thinking", ("reason", "", [("f", '{"x": 1}')])),
        ("reason\n\n" + BLOCK + "</think>" + EOS, "thinking", ("reason", "", [("f", '{"x": 1}')])),
        ("reason\n\n" + BLOCK + "</think>Done." + EOS, "thinking", ("reason", "Done.", [("f", '{"x": 1}')])),
        ("reason" + INVOKE + EOS, "thinking", ("reason", "", [("f", '{"x": 1}')])),
        # A block without the blank line, or without its wrapper.
        ("Hi" + BLOCK + EOS, "chat", ("", "Hi", [("f", '{"x": 1}')])),
        ("Hi\n\n" + INVOKE + EOS, "chat", ("", "Hi", [("f", '{"x": 1}')])),
        # Stray markup in content is dropped.
        ("a</think>b<think>c" + BOS + "d" + EOS, "chat", ("", "abcd", [])),
        ("a</｜DSML｜invoke>b ｜DSML｜ c" + EOS, "chat", ("", "ab  c", [])),
        ('a<｜DSML｜parameter name="x" string="true">v</｜DSML｜parameter>b' + EOS, "chat", ("", "avb", [])),
        # Text after the block becomes content; text after EOS is ignored.
        ("\n\n" + BLOCK + "\nmore" + EOS, "chat", ("", "more", [("f", '{"x": 1}')])),
        ("ok" + EOS + "after", "chat", ("", "ok", [])),
        # Two blocks: both calls are returned.
        ("\n\n" + BLOCK + "\n\n" + BLOCK + EOS, "chat", ("", "", [("f", '{"x": 1}'), ("f", '{"x": 1}')])),
        # EOS inside the reasoning: it stays reasoning.
        ("no end" + EOS, "thinking", ("no end", "", [])),
        # Missing "\n" / ">" in the block are tolerated; a duplicate parameter is dropped.
        ("\n\n" + BLOCK.replace(">\n<", "><") + EOS, "chat", ("", "", [("f", '{"x": 1}')])),
        (
            "\n\n" + BLOCK.replace("</｜DSML｜parameter>", "</｜DSML｜parameter") + EOS,
            "chat",
            ("", "", [("f", '{"x": 1}')]),
        ),
        (
            "\n\n" + BLOCK.replace("</｜DSML｜parameter>", "</｜DSML｜parameter>\n" + INVOKE.split("\n")[1]) + EOS,
            "chat",
            ("", "", [("f", '{"x": 1}')]),
        ),
        # A header without string="…", an invoke without a name: dropped.
        ("\n\n" + BLOCK.replace(' string="false"', "") + EOS, "chat", ("", "", [("f", "{}")])),
        ("\n\n" + BLOCK.replace(' name="f"', "") + EOS, "chat", ("", "", [])),
        # A missing </invoke> or </tool_calls>: the call is closed at the next tag / EOS.
        ("\n\n" + BLOCK.replace("</｜DSML｜invoke>\n", "") + EOS, "chat", ("", "", [("f", '{"x": 1}')])),
        ("\n\n" + BLOCK.replace("\n</｜DSML｜tool_calls>", "") + EOS, "chat", ("", "", [("f", '{"x": 1}')])),
    ],
)
def test_malformed_is_repaired(text, mode, expected):
    for cuts in [(), tuple(range(1, len(text)))] + [(i,) for i in range(len(text))]:
        message, parser, _ = stream(text, mode, cuts)
        assert comparable(message) == expected, cuts
        assert parser.malformed, cuts
        with pytest.raises(ValueError):
            parse_completion(text, mode)


MARKUP = [
    EOS,
    BOS,
    "<think>",
    "</think>",
    DSML,
    "<｜DSML｜",
    "</｜DSML｜",
    "\n\n<｜DSML｜tool_calls>\n",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="f">\n',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="p" string="true">',
    '<｜DSML｜parameter name="q" string="false">',
    "</｜DSML｜parameter>",
    ">",
    "\n",
    '"',
    "<",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(MARKUP), st.text(max_size=4)), max_size=25),
    st.sampled_from(["chat", "thinking"]),
    st.randoms(use_true_random=False),
)
def test_fuzz_never_raises_never_leaks(pieces, mode, rnd):
    text = "".join(pieces)
    cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, 8))) if len(text) > 1 else []
    message, parser, deltas = stream(text, mode, cuts)
    assert_clean(message)
    assert not any("internal error" in issue for issue in parser.issues)
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert all(DSML not in n for n in names)
    try:
        reference = parse_completion(text, mode)
    except ValueError:
        return
    if parser.saw_eos:  # a well-formed completion: the same result, no issues
        assert comparable(message) == comparable(reference) and not parser.issues


def test_long_stream_is_linear():
    random.seed(0)
    body = "".join(random.choice(["a", " ", "\n", "<", "｜", "é"]) for _ in range(60000))
    text = body + "</think>" + body + EOS
    message, parser, _ = stream(text, "thinking", cuts=range(2, len(text), 2))
    assert message["reasoning_content"] == body and message["content"] == body and not parser.issues
