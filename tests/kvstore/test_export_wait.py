"""A handoff's export reported with the step that put it (``RemoteResumeStore.wait_exported``, engine/handoff.py):
against a real kvstore process, the wait returns once the export's put completed (or failed), and an export id
that was never put does not hold it."""

from __future__ import annotations

import pytest

from deepinfer.kvstore.keys import binding_meta, resume_key
from deepinfer.kvstore.remote import RemoteResumeStore

FP = "deepseek-v4-export-wait-fp"
CHAIN, TAIL = b"\x05" * 16, b"\x06" * 16


@pytest.mark.timeout(60)
def test_an_export_is_waited_for_until_put(kvstore_factory) -> None:
    kv = kvstore_factory()
    store = RemoteResumeStore(kv.address, FP, lambda b: b, "test-layout")
    try:
        store.put(resume_key(FP, CHAIN, TAIL, 40), b"state " * 4096, binding_meta(CHAIN, TAIL, 40), "e1")
        assert store.wait_exported(["e1"], 30.0)
        assert store.exported() == [("e1", True, "")]
        assert store.wait_exported(["never-put"], 3600.0)  # nothing in flight under that id: no wait (the timeout)
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_a_failed_export_ends_the_wait_and_says_so(kvstore_factory) -> None:
    kv = kvstore_factory()
    store = RemoteResumeStore(kv.address, FP, lambda b: b, "test-layout")
    try:
        kv.stop()
        store.put(resume_key(FP, CHAIN, TAIL, 40), b"state", binding_meta(CHAIN, TAIL, 40), "e2")
        assert store.wait_exported(["e2"], 45.0)
        [(sid, ok, reason)] = store.exported()
        assert sid == "e2" and not ok and reason
    finally:
        store.close()
