"""Resume points and the kvstore in a worker of two ranks (``LLM(ep=2)``; ``parallel``): one rank offloads a resume
point, the other fetches it for a request placed there, and the output is a cold prefill's, token for token."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model

VOCAB = 129280
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.timeout(600)
def test_a_resume_point_offloaded_by_one_rank_is_fetched_by_the_other(monkeypatch, kvstore_factory, tmp_path):
    model = make_tiny_model(tmp_path / "m", seed=6)
    kw = dict(model=model, dtype="float32", num_pages=64, page_size=16, batch_invariant=True)
    first, busy = ids(45, 1), ids(60, 5)
    follow = first + ids(9, 2)
    cold = LLM(enable_prefix_caching=False, **kw)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in cold.generate(
        [{"prompt_token_ids": p} for p in (busy, follow)], PARAMS)]  # fmt: skip
    kv = kvstore_factory(data_dir=tmp_path / "kv")
    monkeypatch.setenv("DEEPINFER_KVSTORE_URL", kv.address)
    with LLM(ep=2, **kw) as llm:
        dp = llm.engine.scheduler
        llm.generate({"prompt_token_ids": first}, PARAMS)  # on rank 0 (both idle)
        assert dp.ranks[0].num_resume_points > 0 and dp.ranks[1].num_resume_points == 0
        llm.reset_prefix_cache()  # rank 0's resume points go to the kvstore
        llm.engine.runner.remote.flush()  # (rank 0's client wrote them)
        assert kv.metric("deepinfer_kvstore_stored_total", tier="host", reason="put") >= 1
        outs = llm.generate([{"prompt_token_ids": p} for p in (busy, follow)], PARAMS)  # busy on 0, follow on 1
        hits = [s.prefix_hits for s in dp.ranks]
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert got == want
    assert outs[1].num_cached_tokens == 45 and outs[1].cache_tier == "kvstore"
    assert hits == [0, 45]  # served on rank 1, from what rank 0 offloaded
