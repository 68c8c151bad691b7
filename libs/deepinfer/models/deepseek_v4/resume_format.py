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
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load, save

from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState, StateSnapshot

LAYOUT = "deepinfer-resume-v1"
Pages = dict[tuple[str, int], torch.Tensor]


def encode(snapshot: StateSnapshot, pages: Pages) -> bytes:
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


def metadata(data: bytes) -> dict[str, str]:
    """The string metadata of an encoded resume point, read from the safetensors header alone."""
    if len(data) < 8:
        raise ValueError("resume point: truncated header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("resume point: header longer than the data")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {})


def decode(data: bytes) -> tuple[StateSnapshot, Pages]:
    """The snapshot and the full pages of an encoded resume point (on the CPU)."""
    meta = metadata(data)
    if meta.get("layout") != LAYOUT:
        raise ValueError(f"resume point: layout {meta.get('layout')!r}, expected {LAYOUT!r}")
    tensors = load(data)
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
