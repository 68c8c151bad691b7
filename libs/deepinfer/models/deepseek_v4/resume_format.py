"""The byte format of a DeepSeek-V4 / V4.1 resume point outside the device (the family's ``encode_resume`` /
``decode_resume``, ``family.py``): what the kvstore holds and moves between replicas.

A resume point at position ``P`` is the ``P // page_size`` full pages of the prefix (compressed rows and
index keys of every compressed layer) plus the worker's snapshot (window rings, compressor buffers, the
partial page's rows). It is written as one safetensors file (tensors + string metadata, never pickle):

* ``pages.<kind>.<layer>``  ``[full pages, rows per page, dim]``
* ``tail.<kind>.<layer>``   rows of the partial page below ``P``
* ``window.<layer>``        the window ring
* ``buffer.<layer>.<name>.kv`` / ``.score``  the compressor buffers (their start positions in the metadata)

Metadata: ``layout`` (:data:`LAYOUT`), ``position``, ``mtp_tokens``, ``buffer_starts`` and ``history`` (JSON),
``decoder_start``.

``decode`` reads any buffer (``bytes``, or the kvstore client's ``memoryview`` of a mapped file): the pages, the
bulk of it, are views over the buffer (the cache copies them in when it installs them; no copy before), the state's
own tensors are copies (the worker writes into them). The header is checked entry by entry: a known dtype, offsets
inside the data, sizes that match the shapes.
"""

from __future__ import annotations

import json
import math
import struct
import warnings

import torch
from safetensors.torch import save

from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState, StateSnapshot

LAYOUT = "deepinfer-resume-v1"
Pages = dict[tuple[str, int], torch.Tensor]


def encode(snapshot: StateSnapshot, pages: Pages) -> bytes:
    snapshot.wait()  # (its host copies may still be queued)
    st = snapshot.state
    tensors: dict[str, torch.Tensor] = {}
    for (kind, layer), t in pages.items():
        tensors[f"pages.{kind}.{layer}"] = t
    for (kind, layer), t in snapshot.tail.items():
        tensors[f"tail.{kind}.{layer}"] = t
    for layer, w in st.windows.items():
        tensors[f"window.{layer}"] = w
    starts = {}
    for (layer, name), b in st.buffers.items():
        tensors[f"buffer.{layer}.{name}.kv"], tensors[f"buffer.{layer}.{name}.score"] = b.kv, b.score
        starts[f"{layer}.{name}"] = b.start
    meta = {"layout": LAYOUT, "position": str(st.num_tokens), "mtp_tokens": str(st.mtp_tokens),
            "buffer_starts": json.dumps(starts), "compact": "1" if snapshot.compact else "0",
            "history": json.dumps(list(st.history)), "decoder_start": str(st.decoder_start)}  # fmt: skip
    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=meta)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def _header(data: bytes | memoryview) -> tuple[dict, int]:
    """The safetensors header of ``data`` and where its tensor data starts."""
    if len(data) < 8:
        raise ValueError("resume point: truncated header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise ValueError("resume point: header longer than the data")
    header = json.loads(bytes(data[8 : 8 + n]))
    if not isinstance(header, dict):
        raise ValueError("resume point: the header is not a JSON object")
    return header, 8 + n


def metadata(data: bytes | memoryview) -> dict[str, str]:
    """The string metadata of an encoded resume point, read from the safetensors header alone."""
    return _metadata(_header(data)[0])


def _metadata(header: dict) -> dict[str, str]:
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise ValueError("resume point: the metadata is not a JSON object")
    return meta


def _tensors(data: bytes | memoryview, header: dict, base: int) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors buffer, as a view over ``data`` (read only: no copy); ValueError for an entry
    that does not describe bytes of ``data``."""
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[e["dtype"]], [int(d) for d in e["shape"]], e["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"resume point: tensor {name!r}: {exc!r}") from None
        numel = math.prod(shape)
        if min(shape, default=0) < 0 or not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise ValueError(f"resume point: tensor {name!r}: bad shape or offsets")
        if end - begin != numel * dtype.itemsize or base + end > len(data):
            raise ValueError(f"resume point: tensor {name!r}: its bytes do not match its shape or the data")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # (a read-only buffer: nothing writes into these views)
            warnings.simplefilter("ignore", UserWarning)
            out[name] = torch.frombuffer(data, dtype=dtype, count=numel, offset=base + begin).view(shape)
    return out


def decode(data: bytes | memoryview) -> tuple[StateSnapshot, Pages]:
    """The snapshot and the full pages of an encoded resume point (on the CPU; the pages are views over ``data``)."""
    header, base = _header(data)
    meta = _metadata(header)
    if meta.get("layout") != LAYOUT:
        raise ValueError(f"resume point: layout {meta.get('layout')!r}, expected {LAYOUT!r}")
    tensors = {k: t if k.startswith("pages.") else t.clone() for k, t in _tensors(data, header, base).items()}
    starts = json.loads(meta["buffer_starts"])
    history = tuple(int(t) for t in json.loads(meta.get("history", "[]")))
    st = SequenceState(num_tokens=int(meta["position"]), mtp_tokens=int(meta["mtp_tokens"]), history=history,
                       decoder_start=int(meta.get("decoder_start", "0")))  # fmt: skip
    pages: Pages = {}
    tail: Pages = {}
    for name, t in tensors.items():
        part = name.split(".")
        if part[0] == "pages":
            pages[(part[1], int(part[2]))] = t
        elif part[0] == "tail":
            tail[(part[1], int(part[2]))] = t
        elif part[0] == "window":
            st.windows[int(part[1])] = t
        elif part[0] == "buffer" and part[3] == "kv":
            layer, buf = int(part[1]), part[2]
            score = tensors[f"buffer.{layer}.{buf}.score"]
            st.buffers[(layer, buf)] = CompressorBuffer(t, score, int(starts[f"{layer}.{buf}"]))
    return StateSnapshot(st, tail, compact=meta.get("compact") == "1"), pages
