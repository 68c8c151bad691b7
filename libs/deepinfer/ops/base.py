"""The op interface the DeepSeek-V4 family is written against: :class:`Ops`, the union of its layers.

Each layer is a Protocol in its own module, by who needs it:

* ``core.CoreOps``: model-agnostic (products incl. FP8 / grouped, norms, rotary embedding, top-k, routing and the
  experts incl. MXFP4, the quantisation round trips, ``prepare_weights``, ``parallel``): any model;
* ``hyper_connections.HyperConnectionOps``: mHC's residual streams (``hc_*``): DeepSeek-V4 and V4.1;
* ``hybrid_attention.HybridAttentionOps``: the compressors' pooling, the lightning indexer, sparse attention over key
  masks and lists, V4.1's cache round trips: DeepSeek-V4 and V4.1;
* ``decode_step.DecodeStepOps``: the pooled decode step's index and copy glue: DeepSeek-V4 and V4.1.

The models type against :class:`Ops`; a backend's op set implements every layer (its methods either its own or
declared as taken from the reference op set: ``tests/backends/test_fallbacks.py``). :func:`op_names` lists a layer's
methods.
"""

from __future__ import annotations

from typing import Protocol

from deepinfer.ops.core import CoreOps
from deepinfer.ops.decode_step import DecodeStepOps
from deepinfer.ops.hybrid_attention import HybridAttentionOps
from deepinfer.ops.hyper_connections import HyperConnectionOps

LAYERS: tuple[type, ...] = (CoreOps, HyperConnectionOps, HybridAttentionOps, DecodeStepOps)


class Ops(CoreOps, HyperConnectionOps, HybridAttentionOps, DecodeStepOps, Protocol):
    """Every op the DeepSeek-V4 family calls: the model-agnostic core and the V4 extensions (module docstring)."""


def op_names(protocol: type = Ops) -> frozenset[str]:
    """The methods of an op-interface Protocol (a layer or :class:`Ops`), its bases' included."""
    return frozenset(
        name
        for cls in protocol.__mro__
        if cls in LAYERS
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_")
    )


__all__ = ["LAYERS", "CoreOps", "DecodeStepOps", "HybridAttentionOps", "HyperConnectionOps", "Ops", "op_names"]
