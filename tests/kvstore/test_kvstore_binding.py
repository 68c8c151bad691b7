"""Blob keys bound to their content: a resume point's key is derived from (fingerprint, cache salt, tokens) and the
kvstore recomputes it from the blob's own header; a blob put under another prompt's key is refused, and the victim's
next request still resumes from its own state. Keys of another salt find nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.prefix_cache import page_hashes, root_hash
from deepinfer.kvstore.blob import BlobKey, BlobRefused
from deepinfer.kvstore.client import KVStoreClient
from deepinfer.kvstore.keys import binding_meta, check_binding, resume_key, tail_digest
from deepinfer.models.deepseek_v4 import resume_format

VOCAB = 129280
PS = 16
FP = "deepseek-v4-test-fp"
C1, T1, C2, T2 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16, b"\x04" * 16


def test_check_binding_recomputes_the_key_from_the_header():
    key = resume_key(FP, C1, T1, 40)
    check_binding(BlobKey(FP, key), binding_meta(C1, T1, 40))
    check_binding(BlobKey(FP, b"anything", resume_point=False), {})  # not a resume point: not checked
    cases = [
        (BlobKey(FP, key), binding_meta(C2, T2, 40), "key_mismatch"),  # another prompt's header
        (BlobKey(FP, key), binding_meta(C1, T1, 41), "key_mismatch"),  # another position
        (BlobKey("other-model", key), binding_meta(C1, T1, 40), "key_mismatch"),  # another model
        (BlobKey(FP, key), {}, "unbound_key"),
        (BlobKey(FP, key), {"chain": C1.hex(), "tail": "zz", "position": "40"}, "unbound_key"),
        (BlobKey(FP, key), binding_meta(C1[:8], T1, 40), "unbound_key"),
    ]
    for blob_key, meta, reason in cases:
        with pytest.raises(BlobRefused) as err:
            check_binding(blob_key, meta)
        assert err.value.reason == reason


def test_the_remote_index_matches_from_hashes_only_the_same_salt_and_tokens():
    from deepinfer.engine.remote_index import RemoteIndex
    from deepinfer.kvstore.keys import anchor, key_tag

    tokens = list(range(100, 140))  # 2 full pages of 16 and a tail of 8
    root = root_hash(FP, "tenant-a")
    chain = page_hashes(tokens, root, 16, 2)[-1]
    key = resume_key(FP, chain, tail_digest(chain, tokens[32:]), 40)
    index = RemoteIndex(FP, 16, capacity=2)
    index.add(anchor(chain), 40, key_tag(FP, key))  # what a KV event says: no key, no token
    hit = index.lookup([*tokens, 7, 8], root, 41)
    assert hit is not None and hit.key == key and hit.position == 40
    assert index.lookup([*tokens, 7], root_hash(FP, "tenant-b"), 40) is None  # another salt
    assert index.lookup([*tokens, 7], root_hash(FP, None), 40) is None  # no salt
    assert index.lookup([*tokens[:39], 5, 7], root, 40) is None  # another last token
    assert index.lookup([*tokens, 7], root, 39) is None  # it would leave nothing to compute
    assert RemoteIndex("other-model", 16).lookup([*tokens, 7], root, 40) is None
    index.add(b"a" * 16, 16, b"t1")
    index.add(b"b" * 16, 16, b"t2")  # beyond the capacity: the least recently used entry goes
    assert len(index) == 2 and index.lookup([*tokens, 7], root, 40) is None
    index.remove(b"t1")
    index.remove(b"unknown")
    assert len(index) == 1


@pytest.mark.timeout(60)
def test_a_forged_or_unbound_resume_point_is_refused_by_the_service(kvstore_factory):
    kv = kvstore_factory()
    victim, other = resume_key(FP, C1, T1, 40), resume_key(FP, C2, T2, 40)

    async def main():
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            await c.put(FP, victim, b"victim state", binding_meta(C1, T1, 40))
            await c.put(FP, other, b"other state", binding_meta(C2, T2, 40))
            data, meta = await c.get(FP, other)  # what another tenant holds, with its valid checksum
            for forged_meta in (meta, binding_meta(C2, T2, 41), {}):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.put(FP, victim, data, forged_meta)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "key.hash" in err.value.details() or "meta" in err.value.details()
            assert await c.get(FP, victim) == (b"victim state", binding_meta(C1, T1, 40))
            await c.put(FP, b"\xee" * 16, b"opaque", resume_point=False)  # not a resume point: no binding needed
            assert await c.get(FP, b"\xee" * 16, resume_point=False) == (b"opaque", {})

    asyncio.run(main())
    assert kv.metric("deepinfer_kvstore_refused_total", reason="key_mismatch") == 2
    assert kv.metric("deepinfer_kvstore_refused_total", reason="unbound_key") == 1


# -- the attack end to end: an engine whose resume points move to a real kvstore process ---------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_bind") / "m", seed=6)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[int, tuple]:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}, params)
    return out.num_cached_tokens, tuple(out.outputs[0].token_ids)


def key_for(fp: str, tokens: list[int], salt: str | None) -> bytes:
    """The key a resume point at the end of ``tokens`` has under ``salt`` (the derivation the kvstore checks)."""
    full = len(tokens) // PS
    chain = page_hashes(tokens, root_hash(fp, salt), PS, full)[-1]
    return resume_key(fp, chain, tail_digest(chain, tokens[full * PS :]), len(tokens))


def test_a_blob_forged_under_another_prompts_key_is_refused_and_the_victim_keeps_its_output(
    model_dir, monkeypatch, kvstore_factory, tmp_path
):
    kv = kvstore_factory(data_dir=tmp_path / "kv")
    monkeypatch.setenv("DEEPINFER_KVSTORE_URL", kv.address)
    llm = LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True)
    cold = LLM(model=model_dir, dtype="float32", num_pages=64, page_size=PS, batch_invariant=True,
               enable_prefix_caching=False)  # fmt: skip
    fp = llm.engine.scheduler.config.fingerprint
    victim, attacker = ids(45, 21), ids(40, 22)
    for prompt in (victim, attacker):  # each prompt's resume points move to the kvstore
        run(llm, prompt)
        llm.reset_prefix_cache()
        llm.engine.runner.remote.flush()

    async def forge() -> None:
        async with KVStoreClient(kv.address, timeout_s=30) as c:
            stolen = await c.get_blob(fp, key_for(fp, attacker, None))  # the attacker's own blob: valid checksum
            assert stolen is not None and resume_format.metadata(stolen.data)["position"] == "40"
            assert not any(str(t) in stolen.meta.values() for t in attacker)  # digests, never token ids
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.put(fp, key_for(fp, victim, None), stolen.data, stolen.meta, stolen.layout)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert await c.get(fp, key_for(fp, victim, "tenant-b")) is None  # another salt: another key, nothing

    asyncio.run(forge())
    assert kv.metric("deepinfer_kvstore_refused_total", reason="key_mismatch") == 1
    follow = victim + ids(9, 23)
    got = run(llm, follow)
    assert got == (45, run(cold, follow)[1])  # resumed from its own state, fetched from the kvstore
    salted = victim + ids(5, 24)
    assert run(llm, salted, salt="tenant-b") == (0, run(cold, salted)[1])  # another tenant finds nothing
    assert llm.engine.runner.remote.puts_failed == 0
