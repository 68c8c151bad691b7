"""Batch invariance (docs/determinism.md, issue 4): with the batch-invariant ops a sequence's logits are
bit-identical alone and inside any batch, at any position in it, however its prefill is chunked.

The same harness run with the default ops finds differences, so the comparison can fail. The step loop
(``bench/engine/compositions.py``) is the one ``bench/engine/batch_invariance.py`` runs on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from bench.engine.compositions import split, target_logits
from deepinfer.backends.reference import BatchInvariantOps, ReferenceOps
from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model

PAGE = 16
TARGET_LEN = 150  # past the window (128 in the base config) and many compressed rows
COMPOSITIONS = 8


@pytest.fixture(scope="module", params=["base", "odd"])
def model(request: pytest.FixtureRequest, tiny_dirs: dict) -> DeepseekV4Model:
    path = tiny_dirs[request.param]
    m = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"), BatchInvariantOps())
    load_checkpoint(m, path, dtype=torch.float32, progress=False)
    return m


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def composition(model: DeepseekV4Model, target: list[int], seed: int) -> tuple[list, list, random.Random]:
    """The target among 1–16 other sequences: some prefilling in chunks, some decoding one token a step,
    the target itself prefilled in random chunks and then decoded."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    others = [tokens(rng.randint(1, 40), seed * 100 + j, vocab) for j in range(rng.randint(1, 16))]
    plans = []
    for o in others:
        if rng.random() < 0.4:  # a decoding sequence: a short prefill, then one token per step
            head = rng.randint(1, len(o))
            plans.append([head] + [1] * (len(o) - head))
        else:
            plans.append(split(len(o), rng, 24))
    prefill = TARGET_LEN - 8
    delay = [0] * rng.randint(0, 3)  # the target may join late, when the others are mid-flight
    target_plan = delay + split(prefill, rng, rng.choice([7, 33, 100, prefill])) + [1] * 8
    return [target] + others, [target_plan] + plans, rng


def alone(model: DeepseekV4Model, target: list[int]) -> torch.Tensor:
    return target_logits(model, [target], [[TARGET_LEN - 8] + [1] * 8], None, PAGE)


def differing(model: DeepseekV4Model, seeds: range) -> list[tuple[int, float]]:
    target = tokens(TARGET_LEN, 7, model.config.vocab_size)
    ref = alone(model, target)
    out = []
    for seed in seeds:
        seqs, plans, rng = composition(model, target, seed)
        got = target_logits(model, seqs, plans, rng, PAGE)
        if not torch.equal(got, ref):
            out.append((seed, (got - ref).abs().max().item()))
    return out


def test_logits_are_bit_identical_in_any_batch(model: DeepseekV4Model) -> None:
    n = COMPOSITIONS if model.config.hidden_size == 64 else 4  # all 8 on the base config
    assert differing(model, range(n)) == []


def test_bit_identical_with_two_threads(model: DeepseekV4Model) -> None:
    torch.set_num_threads(2)  # the worker runs several intra-op threads; BLAS splits work by them
    try:
        assert differing(model, range(100, 102)) == []
    finally:
        torch.set_num_threads(1)


def test_bit_identical_with_the_quantisation_simulation(model: DeepseekV4Model) -> None:
    model.set_quant_sim(True)
    try:
        assert differing(model, range(200, 202)) == []
    finally:
        model.set_quant_sim(False)


def test_the_default_ops_are_not_invariant_and_agree_within_rounding(model: DeepseekV4Model) -> None:
    """The control: the same harness sees the default ops' batch dependence (so it can fail), and the
    invariant ops compute the same function (the default ops are checked against transformers)."""
    target = tokens(TARGET_LEN, 7, model.config.vocab_size)
    invariant = alone(model, target)
    model.ops = ReferenceOps()
    try:
        diffs = differing(model, range(4))
        default = alone(model, target)
    finally:
        model.ops = BatchInvariantOps()
    assert diffs, "the default ops gave bit-identical logits in every composition: the check is blind"
    assert max(d for _, d in diffs) < 1e-4
    assert (invariant - default).abs().max().item() < 1e-4
