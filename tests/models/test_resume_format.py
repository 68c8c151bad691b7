"""Resume points as bytes (``models/deepseek_v4/resume_format.py``): a sequence's state encoded, decoded into another
cache at other page ids, continues exactly as the original (bit-identical logits), from ``bytes`` and from a
read-only mapped file (the kvstore client's same-host path), whose pages are then views over the file's memory and
the state's tensors copies the worker may write. Malformed headers are refused entry by entry."""

from __future__ import annotations

import json
import mmap
import struct

import numpy as np
import pytest
import torch

from deepinfer.checkpoint.loader import load_checkpoint
from deepinfer.models.deepseek_v4 import resume_format
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState, StateSnapshot
from deepinfer.runtime.host_copy import HostCopies

PS = 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["base", "odd"])
def model(request: pytest.FixtureRequest, tiny_dirs: dict) -> DeepseekV4Model:
    path = tiny_dirs[request.param]
    m = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"))
    load_checkpoint(m, path, dtype=torch.float32, progress=False)
    return m


def step(model, cache, state, table, tokens) -> torch.Tensor:
    batch = ForwardBatch.build([SeqChunk(state, state.num_tokens, len(tokens), table)], [tokens])
    return model.logits(model(batch, cache))


def mapped(data: bytes, tmp_path) -> tuple[memoryview, int, int]:
    """``data`` through a file mapped read-only, as the kvstore client reads it; the map's address range."""
    f = tmp_path / "blob"
    f.write_bytes(data)
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), len(data), access=mmap.ACCESS_READ)
    lo = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
    return memoryview(m), lo, lo + len(data)


@pytest.mark.parametrize("source", ["bytes", "mapped"])
@pytest.mark.parametrize("position", [37, 48])  # a partial last page, and a page boundary
def test_a_resume_point_survives_bytes_and_other_pages(model, position, source, tmp_path):
    c = model.config
    ids = torch.randint(2, c.vocab_size, (position + 5,), generator=torch.Generator().manual_seed(position)).tolist()
    a = PagedKVCache(c, 8, PS)
    table_a = torch.tensor([6, 2, 7, 1])
    st = SequenceState()
    step(model, a, st, table_a, ids[:position])
    full = position // PS
    data = resume_format.encode(StateSnapshot.take(st, a, table_a), a.read_pages(table_a[:full]))
    assert resume_format.metadata(data)["position"] == str(position)
    ref = [step(model, a, st, table_a, [t]) for t in ids[position:]]

    if source == "mapped":
        view, lo, hi = mapped(data, tmp_path)
        snap, pages = resume_format.decode(view)
        assert pages and all(lo <= t.data_ptr() < hi for t in pages.values())  # views: no copy
        state = [*snap.state.windows.values(), *(x for b in snap.state.buffers.values() for x in (b.kv, b.score))]
        assert state and not any(lo <= t.data_ptr() < hi for t in state)  # copies: the worker writes into them
    else:
        snap, pages = resume_format.decode(data)
    b = PagedKVCache(c, 8, PS)
    table_b = torch.tensor([3, 0, 5, 4])
    b.write_pages(table_b[:full], pages)
    st_b = snap.restore(b, table_b, "cpu")
    got = [step(model, b, st_b, table_b, [t]) for t in ids[position:]]
    for x, y in zip(ref, got):
        assert torch.equal(x, y)


@cuda
def test_a_resume_point_taken_while_the_gpu_is_busy_never_waits_and_encodes_as_taken(tiny_dirs):
    """The worker's snapshot and its offload's pages: their host copies are queued (no wait for the steps ahead of
    them on the GPU) and, once complete, encode to the bytes of the state as it was when they were queued; a restore
    queued right behind them (its copies back to the GPU) does not wait either, and gets the same state."""
    c = DeepseekV4Config.from_file(tiny_dirs["base"] / "config.json")
    table = torch.tensor([6, 2, 7, 1])

    def sequence() -> tuple[PagedKVCache, SequenceState, PagedKVCache]:
        """A cache and a state of random values on the GPU, and an empty cache to restore into."""
        gpu = PagedKVCache(c, 8, PS, device="cuda")
        for t in [*gpu.rows.values(), *gpu.index_keys.values()]:
            t.normal_()
        st = SequenceState(num_tokens=37, mtp_tokens=37, history=(5, 6))
        st.windows = {0: torch.randn(8, 4, device="cuda"), 2: torch.randn(8, 4, device="cuda")}
        kv, score = torch.randn(3, 4, device="cuda"), torch.randn(3, 4, device="cuda")
        st.buffers = {(1, "kv"): CompressorBuffer(kv, score, 32)}
        return gpu, st, PagedKVCache(c, 8, PS, device="cuda")

    def cycle(gpu: PagedKVCache, st: SequenceState, other: PagedKVCache) -> tuple:
        """Take, read the pages for an offload, let later work overwrite the sources, restore elsewhere."""
        snap = StateSnapshot.take(st, gpu, gpu_table)
        copy = HostCopies("cuda")
        pages = {key: copy(t) for key, t in gpu.read_pages(gpu_table[:2]).items()}
        ready = copy.done()
        for t in [*gpu.rows.values(), *gpu.index_keys.values(), *st.windows.values()]:
            t.zero_()  # the steps after: they must not reach the copies
        other.write_pages(other_table[:2], pages)
        return snap, pages, ready, snap.restore(other, other_table, "cuda")

    other_table = torch.tensor([3, 0, 5, 4], device="cuda")
    gpu_table = table.cuda()  # the worker's block tables live on the device (a copy from here would wait)
    cycle(*sequence())  # once untimed: the device and pinned-memory allocators' blocks
    gpu, st, other = sequence()
    host = PagedKVCache(c, 8, PS)  # the same values on the host: what the bytes must hold
    for src, dst in ((gpu.rows, host.rows), (gpu.index_keys, host.index_keys)):
        for layer, t in src.items():
            dst[layer].copy_(t.cpu())
    expected = resume_format.encode(StateSnapshot.take(st.clone("cpu"), host, table), host.read_pages(table[:2]))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    queued = torch.cuda.Event()
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        snap, pages, ready, restored = cycle(gpu, st, other)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not queued.query(), "the host waited for the GPU"
    assert snap.ready is not None and ready is not None
    ready.synchronize()
    assert same_blob(resume_format.encode(snap, pages), expected)  # (encode waits for the snapshot's own copies)
    again = StateSnapshot.take(restored, other, other_table)  # what the restore put on the GPU, read back
    assert same_blob(resume_format.encode(again, other.read_pages(other_table[:2], "cpu")), expected)


def same_blob(a: bytes, b: bytes) -> bool:
    """The same tensors and metadata (the bytes may differ: safetensors writes the metadata in no fixed order)."""
    from safetensors.torch import load

    ta, tb = load(a), load(b)
    same_tensors = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    return same_tensors and resume_format.metadata(a) == resume_format.metadata(b)


def test_bad_bytes_are_refused():
    with pytest.raises(ValueError, match="truncated"):
        resume_format.decode(b"\x01")
    with pytest.raises(ValueError, match="layout"):
        from safetensors.torch import save

        resume_format.decode(save({"x": torch.zeros(1)}, metadata={"layout": "other"}))


def forged(header: dict, data: bytes = b"\0" * 16) -> bytes:
    text = json.dumps({"__metadata__": {"layout": resume_format.LAYOUT, "position": "0", "mtp_tokens": "0",
                                        "buffer_starts": "{}"}, **header}).encode()  # fmt: skip
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]},  # no such dtype
        {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]},  # past the data
        {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]},  # bytes that are not its shape's
        {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]},  # a negative dimension
        {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]},  # offsets backwards
        {"dtype": "F32", "shape": [4], "data_offsets": ["0", 16]},  # not an offset
        {"dtype": "F32", "shape": [4]},  # no offsets
    ],
)
def test_a_forged_header_is_refused(entry: dict) -> None:
    with pytest.raises(ValueError, match="pages.rows.1"):
        resume_format.decode(forged({"pages.rows.1": entry}))


@pytest.mark.parametrize("text", [b"[1, 2]", b'{"__metadata__": [1]}'])
def test_a_header_that_is_not_an_object_is_refused(text: bytes) -> None:
    with pytest.raises(ValueError, match="JSON object"):
        resume_format.decode(struct.pack("<Q", len(text)) + text)
