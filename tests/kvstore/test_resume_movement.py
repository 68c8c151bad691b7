"""Resume points moving between the device prefix cache and the kvstore (issue 5): evicted from the device,
offloaded by the worker, fetched back on a later hit — exact; a damaged blob, a restarted kvstore and a
kvstore that is down all end in correct output (recomputed where needed)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model

VOCAB = 129280
PS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_move") / "m", seed=6)


@pytest.fixture(scope="module")
def cold(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True,
               enable_prefix_caching=False)  # fmt: skip


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompt: list[int]) -> tuple[int, tuple, list]:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    assert out.cache_tier == ("kvstore" if out.num_cached_tokens else None)  # the device cache was emptied
    return out.num_cached_tokens, tuple(out.outputs[0].token_ids), [dict(d) for d in out.outputs[0].logprobs]


def warm(model_dir, monkeypatch, address: str) -> LLM:
    monkeypatch.setenv("DEEPINFER_KVSTORE_URL", address)
    return LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True)


def offload_everything(llm: LLM) -> None:
    llm.reset_prefix_cache()
    llm.engine.runner.remote.flush()


def test_evicted_resume_points_come_back_from_the_kvstore(model_dir, cold, monkeypatch, kvstore_factory, tmp_path):
    kv = kvstore_factory(data_dir=tmp_path / "kv")
    llm = warm(model_dir, monkeypatch, kv.address)
    first = ids(45, 1)
    run(llm, first)
    offload_everything(llm)
    assert llm.engine.scheduler.pages.num_used == 0 and not llm.engine.runner.snapshots
    assert kv.metric("deepinfer_kvstore_stored_total", tier="host", reason="put") >= 1
    follow = first + ids(9, 2)
    got = run(llm, follow)
    assert got[0] == 45  # the prompt-end resume point, fetched back
    assert got[1:] == run(cold, follow)[1:]  # bit-identical to a cold prefill
    # on the kvstore's host the state moved through its shared directory, not the stream
    shared = {op: kv.metric("deepinfer_kvstore_transfers_total", op=op, path="shared") for op in ("put", "get")}
    assert shared["put"] >= 1 and shared["get"] == 1, shared

    # restart the kvstore (same address, same data dir): served from disk
    offload_everything(llm)
    kv.stop()
    kv.start()
    again = first + ids(5, 3)
    got = run(llm, again)
    assert got[0] == 45 and got[1:] == run(cold, again)[1:]

    # damage the stored blobs: refused, recomputed, same output
    offload_everything(llm)
    assert kv.metric("deepinfer_kvstore_transfers_total", op="put", path="shared") >= 1  # the new directory, asked
    kv.stop()
    for f in (tmp_path / "kv").glob("*.kvb"):
        raw = bytearray(f.read_bytes())
        raw[-10] ^= 0xFF
        f.write_bytes(bytes(raw))
    kv.start()
    damaged = first + ids(7, 4)
    got = run(llm, damaged)
    assert got[0] == 0 and got[1:] == run(cold, damaged)[1:]
    assert llm.engine.scheduler.prefix_misses["kvstore_data_loss"] == 1
    assert kv.metric("deepinfer_kvstore_corrupt_total", tier="disk") >= 1


def test_kvstore_down_means_recompute_with_identical_output(model_dir, cold, monkeypatch, kvstore_factory):
    kv = kvstore_factory()
    llm = warm(model_dir, monkeypatch, kv.address)
    first = ids(40, 5)
    run(llm, first)
    offload_everything(llm)
    kv.stop()
    follow = first + ids(6, 6)
    got = run(llm, follow)
    assert got[0] == 0 and got[1:] == run(cold, follow)[1:]
    assert llm.engine.scheduler.prefix_misses["kvstore_unavailable"] == 1
    assert llm.engine.runner.remote.puts_failed == 0
