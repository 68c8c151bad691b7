"""A DeepSeek-V4.1 resume point (window rings, the ratio-2 owners' pending half groups, the Engram token history,
the owners' pages) offloaded to the kvstore and fetched back on a later hit: bit-identical to a cold prefill
(batch-invariant ops, the cache formats on as served)."""

from __future__ import annotations

import torch

from deepinfer import LLM, SamplingParams

PS = 16


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompt: list[int]) -> tuple[int, str | None, list[int], list]:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    return out.num_cached_tokens, out.cache_tier, out.outputs[0].token_ids, out.outputs[0].logprobs


def test_v41_resume_points_move_through_the_kvstore(tiny_v41_dir, monkeypatch, kvstore_factory, tmp_path) -> None:
    cold = LLM(model=tiny_v41_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True,
               enable_prefix_caching=False)  # fmt: skip
    kv = kvstore_factory(data_dir=tmp_path / "kv")
    monkeypatch.setenv("DEEPINFER_KVSTORE_URL", kv.address)
    llm = LLM(model=tiny_v41_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True)
    first = ids(45, 1)  # odd: a ratio-2 owner holds a pending half group at the resume point
    run(llm, first)
    llm.reset_prefix_cache()
    llm.engine.runner.remote.flush()
    assert llm.engine.scheduler.pages.num_used == 0 and not llm.engine.runner.snapshots
    follow = first + ids(9, 2)
    got = run(llm, follow)
    assert got[:2] == (45, "kvstore")  # the prompt-end resume point, fetched back
    assert got[2:] == run(cold, follow)[2:]
