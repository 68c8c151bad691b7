"""Reproducibility through the offline API (issue 4): with batch-invariant ops, a seeded request at
temperature 1 gives the same tokens and bit-identical logprobs and prompt logprobs alone and inside
random batches, under different step budgets (so different prefill chunkings); different seeds differ;
``LLM.determinism`` says what is covered."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model

VOCAB = 129280
TARGET = torch.randint(2, VOCAB, (150,), generator=torch.Generator().manual_seed(11)).tolist()


def target_params(seed: int = 1234) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=12, seed=seed, logprobs=3, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_det") / "m", seed=0)


@pytest.fixture(scope="module")
def engines(model_dir) -> list[LLM]:
    """Three engines over the same weights: one-shot prefill, and step budgets of 61 and 24 tokens."""
    return [
        LLM(model=model_dir, dtype="float32", num_pages=256, page_size=16, batch_invariant=True, **kw)
        for kw in ({}, {"max_num_batched_tokens": 61}, {"max_num_batched_tokens": 24})
    ]


def signature(out) -> tuple:
    o = out.outputs[0]
    return (
        tuple(o.token_ids),
        tuple(tuple(d.items()) for d in o.logprobs),
        tuple(None if d is None else tuple(d.items()) for d in out.prompt_logprobs),
    )


def neighbours(rng: random.Random) -> tuple[list, list[SamplingParams]]:
    prompts, params = [], []
    for _ in range(rng.randint(1, 12)):
        prompts.append({"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 60))]})
        kind = rng.choice(["greedy", "unseeded", "seeded"])
        temperature = 0.0 if kind == "greedy" else rng.choice([0.7, 1.0, 1.3])
        seed = rng.randrange(1 << 30) if kind == "seeded" else None
        params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=rng.randint(1, 20)))
    return prompts, params


def test_seeded_sampling_is_identical_in_any_batch(engines: list[LLM]):
    (alone,) = engines[0].generate({"prompt_token_ids": TARGET}, target_params())
    ref = signature(alone)
    assert len(ref[0]) == 12 and len(set(ref[0])) > 1
    rng = random.Random(5)
    for i in range(3):  # a composition per engine (one-shot prefill, and each step budget)
        llm = engines[i]
        prompts, params = neighbours(rng)
        at = rng.randint(0, len(prompts))
        prompts.insert(at, {"prompt_token_ids": TARGET})
        params.insert(at, target_params())
        outs = llm.generate(prompts, params)
        assert signature(outs[at]) == ref, f"composition {i} (engine {i}, position {at})"


def test_runs_repeat_and_different_seeds_differ(engines: list[LLM]):
    def run(seed: int) -> tuple[int, ...]:
        return tuple(engines[2].generate({"prompt_token_ids": TARGET}, target_params(seed))[0].outputs[0].token_ids)

    first, again = [run(s) for s in (1, 2)], [run(s) for s in (1, 2)]
    assert first == again and first[0] != first[1]


def test_determinism_report(engines: list[LLM], model_dir):
    d = engines[0].determinism
    assert d.batch_invariant and d.deterministic_sampling
    assert any("chunked prefill" in c for c in d.covers)
    assert d.requires["accelerator"] == "cpu" and d.requires["dtype"] == "float32"
    assert d.requires["intra_op_threads"] == str(torch.get_num_threads())
    assert "batch-invariant" in d.requires["ops"]
    plain = LLM(model=model_dir, dtype="float32", num_pages=16, page_size=16, batch_invariant=False).determinism
    assert not plain.batch_invariant and plain.requires["ops"] == "default"
    assert "batch composition" in plain.covers[0]
