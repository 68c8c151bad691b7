"""PutAssembler: blobs back from chunk streams; bad blobs refused, malformed streams rejected naming the field."""

from __future__ import annotations

import os
import zlib

import pytest

from deepinfer.kvstore.assembly import PutAssembler, StreamError, blob_chunks
from deepinfer.kvstore.blob import Blob, BlobKey, BlobRefused
from deepinfer.v1 import kvstore_pb2


def feed_all(chunks, max_blob_bytes: int = 1 << 20) -> list:
    asm = PutAssembler(max_blob_bytes)
    out = [r for c in chunks if (r := asm.feed(c)) is not None]
    asm.finish()
    return out


def chunks_of(b: Blob, size: int = 10) -> list[kvstore_pb2.PageChunk]:
    return list(blob_chunks(b, size))


def test_blobs_round_trip_through_chunks():
    blobs = [Blob.build(BlobKey("fp", bytes([i]) * 8, i % 2 == 0), os.urandom(n), "v1", {"n": str(n)})
             for i, n in enumerate([1, 10, 25, 100])]  # fmt: skip
    chunks = [c for b in blobs for c in chunks_of(b)]
    assert len(chunks) == 1 + 1 + 3 + 10
    assert feed_all(chunks) == blobs
    assert all(c.crc32 == 0 and not c.meta and not c.layout for c in chunks[3:5])  # only first chunks carry them


def test_bad_blobs_are_refused_and_the_stream_goes_on():
    good = Blob.build(BlobKey("fp", b"k" * 8), b"payload")
    bad_crc = Blob(BlobKey("fp", b"c" * 8), b"payload", crc32=zlib.crc32(b"payload") ^ 1)
    cases = [
        (Blob.build(BlobKey("fp", b""), b"abc"), "bad_key", "key.hash"),
        (Blob.build(BlobKey("fp", b"x" * 65), b"abc"), "bad_key", "key.hash"),
        (Blob.build(BlobKey("", b"k"), b"abc"), "bad_fingerprint", "model_fingerprint"),
        (Blob.build(BlobKey("fp", b"k"), b""), "empty", "total_bytes"),
        (Blob.build(BlobKey("fp", b"k"), bytes(101)), "too_large", "total_bytes"),
        (Blob.build(BlobKey("fp", b"k"), b"a", meta={"m": "x" * 20000}), "bad_meta", "meta"),
        (bad_crc, "crc_mismatch", "crc32"),
    ]
    for bad, reason, field in cases:
        out = feed_all([*chunks_of(bad), *chunks_of(good)], max_blob_bytes=100)
        assert isinstance(out[0], BlobRefused) and out[0].reason == reason, (reason, out)
        assert str(out[0]).startswith(field + ":")
        assert out[1] == good


def chunk(offset: int, data: bytes, total: int, key: bytes = b"k", fp: str = "fp") -> kvstore_pb2.PageChunk:
    return kvstore_pb2.PageChunk(
        key=kvstore_pb2.PageKey(hash=key, resume_point=True), model_fingerprint=fp, offset=offset,
        total_bytes=total, data=data, crc32=zlib.crc32(b"abcd"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("field", "chunks"),
    [
        ("offset", [chunk(1, b"ab", 4)]),  # first chunk not at 0
        ("offset", [chunk(0, b"ab", 4), chunk(1, b"cd", 4)]),  # overlap
        ("offset", [chunk(0, b"ab", 4), chunk(3, b"d", 4)]),  # gap
        ("key", [chunk(0, b"ab", 4), chunk(2, b"cd", 4, key=b"other")]),  # interleaved
        ("model_fingerprint", [chunk(0, b"ab", 4), chunk(2, b"cd", 4, fp="fp2")]),
        ("total_bytes", [chunk(0, b"ab", 4), chunk(2, b"cd", 5)]),
        ("total_bytes", [chunk(0, b"ab", 4)]),  # the stream ends mid-blob
        ("data", [chunk(0, b"abcde", 4)]),  # past total_bytes
    ],
)
def test_malformed_streams_name_the_field(field, chunks):
    with pytest.raises(StreamError) as err:
        feed_all(chunks)
    assert str(err.value).startswith(field + ":")


def test_later_chunks_may_leave_fingerprint_and_total_empty():
    out = feed_all([chunk(0, b"ab", 4), chunk(2, b"cd", 0, fp="")])
    assert out == [Blob(BlobKey("fp", b"k"), b"abcd", crc32=zlib.crc32(b"abcd"))]
