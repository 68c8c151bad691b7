import dataclasses

import pytest

from deepinfer.sampling_params import SO_SCHEMA_TYPES, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.max_tokens == 16
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.seed is None and p.seq_seed is None and p.effective_seed is None
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.so_args is None
    assert p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.min_tokens == 0
    assert not p.greedy


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", {"n": 2}),
        ("n", {"n": 0}),
        ("temperature", {"temperature": -1}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": "0.5"}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": -0.1}),
        ("top_p", {"top_p": 1.01}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 1.5}),
        ("min_p", {"min_p": -0.01}),
        ("min_p", {"min_p": 1.5}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("max_tokens", {"max_tokens": 2.0}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
        ("logprobs", {"logprobs": -1}),
        ("logprobs", {"logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
        ("prompt_logprobs", {"prompt_logprobs": 21}),
        ("stop_token_ids", {"stop_token_ids": [1, -1]}),
        ("stop_token_ids", {"stop_token_ids": ["a"]}),
        ("stop", {"stop": ""}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop", {"stop": [1]}),
        ("seed", {"seed": "7"}),
        ("seq_seed", {"seq_seed": 1, "seed": 2}),
        ("so_args", {"so_args": "regex"}),
        ("so_args.schema_type", {"so_args": {"schema_type": "xml", "schema": "x"}}),
        ("so_args.schema_type", {"so_args": {"schema": "x"}}),
        ("so_args.schema", {"so_args": {"schema_type": "regex"}}),
        ("so_args.schema", {"so_args": {"schema_type": "regex", "schema": {"a": 1}}}),
        ("so_args.schema", {"so_args": {"schema_type": "ebnf", "schema": ""}}),
        ("so_args.schema", {"so_args": {"schema_type": "json_schema", "schema": "{not json"}}),
        ("so_args.schema", {"so_args": {"schema_type": "json_schema", "schema": "[1, 2]"}}),
        ("so_args.schema", {"so_args": {"schema_type": "json", "schema": 3}}),
        ("so_args.schema", {"so_args": {"schema_type": "json", "schema": None}}),
        ("so_args.schema", {"so_args": {"schema_type": "json_object", "schema": "[ab]"}}),  # (never dropped)
        ("so_args.strict", {"so_args": {"schema_type": "regex", "schema": "x", "strict": True}}),
    ],
)
def test_bad_inputs_raise_naming_field(field, kwargs):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    assert str(ei.value).startswith(field + " "), str(ei.value)


def test_temperature_message_format():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_unknown_schema_type_lists_allowed():
    with pytest.raises(ValueError) as ei:
        SamplingParams(so_args={"schema_type": "xml", "schema": "x"})
    for t in SO_SCHEMA_TYPES:
        assert t in str(ei.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0, "top_k": -1},
        {"temperature": 2.5, "top_p": 1.0, "top_k": 50, "min_p": 1.0},
        {"top_p": 1e-9, "min_p": 0.0},
        {"max_tokens": None},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"logprobs": 20, "prompt_logprobs": 0},
        {"stop": ["a", "b"], "stop_token_ids": [0, 5]},
        {"seed": 0},
        {"seq_seed": 3},
        {"seed": 3, "seq_seed": 3},
        {"so_args": {"schema_type": "regex", "schema": "[a-z]+"}},
        {"so_args": {"schema_type": "ebnf", "schema": "root ::= 'a'"}},
        {"so_args": {"schema_type": "json_schema", "schema": {"type": "object"}}},
        {"so_args": {"schema_type": "json_schema", "schema": '{"type": "object"}'}},
        {"so_args": {"schema_type": "json", "schema": {}}},
        {"so_args": {"schema_type": "json_object"}},
        {"so_args": {"schema_type": "structural_tag", "schema": {"structures": [], "triggers": []}}},
    ],
)
def test_good_inputs_pass(kwargs):
    SamplingParams(**kwargs)


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


def test_greedy_iff_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_seed_aliases():
    assert SamplingParams(seed=5).effective_seed == 5
    assert SamplingParams(seq_seed=6).effective_seed == 6
    assert SamplingParams(seed=7, seq_seed=7).effective_seed == 7
    assert SamplingParams(seed=0).effective_seed == 0
    with pytest.raises(ValueError, match="^seq_seed"):
        SamplingParams(seed=1, seq_seed=2)


def test_validate_for_model():
    p = SamplingParams(stop_token_ids=[0, 99])
    p.validate_for_model(100)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        p.validate_for_model(99)
    SamplingParams().validate_for_model(1)


def test_replace_revalidates():
    p = SamplingParams(stop="x")
    q = dataclasses.replace(p, temperature=0.0)
    assert q.stop == ["x"] and q.greedy
    with pytest.raises(ValueError, match="^top_p"):
        dataclasses.replace(p, top_p=2.0)
