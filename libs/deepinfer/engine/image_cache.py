"""Encoded images on the worker: a cache of features across requests, and the budget of the features requests hold.

:class:`FeatureCache` wraps an ``ImageEncoder`` (``model_api.ImageEncoder``): the features of an image are kept by
the :func:`~deepinfer.engine.multimodal.content_digest` of its bytes, least recently used first out, up to a size in
bytes (``DEEPINFER_IMAGE_FEATURE_CACHE_BYTES``), so the same image sent again (a follow-up turn, the samples of an
``n`` > 1 request, another user) skips the vision tower. Two encodings of the same pixels are two images.

:class:`FeatureBudget` counts the bytes of the prepared payloads that requests in flight hold on the worker
(``DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES``): a request whose features would pass it is refused (``Overloaded``,
RESOURCE_EXHAUSTED: retry later) rather than queued, so a burst of image requests cannot exhaust the memory; one
whose features alone pass it can never run (ValueError, INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch

from deepinfer.engine.multimodal import content_digest
from deepinfer.serving.errors import Overloaded


def nbytes(obj: Any) -> int:
    """The bytes of the tensors ``obj`` holds: a tensor, or a dataclass's tensor fields (one level down too)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, list | tuple):
        return sum(nbytes(x) for x in obj)
    return 0


class FeatureCache:
    """An ``ImageEncoder`` that remembers: ``encode(bytes)`` runs ``encoder`` only for images it does not hold.
    ``encoded`` counts the encoder's runs, ``hits`` the images answered from the cache. Not thread-safe (the worker
    encodes under its step lock)."""

    def __init__(self, encoder: Any, capacity_bytes: int) -> None:
        self.encoder, self.capacity = encoder, capacity_bytes
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.encoded = self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, image: bytes) -> Any:
        key = content_digest(image)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found[0]
        features = self.encoder.encode(image)
        self.encoded += 1
        size = nbytes(features)
        if 0 < size <= self.capacity:
            self._entries[key] = (features, size)
            self.bytes += size
            while self.bytes > self.capacity:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
        return features

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


class FeatureBudget:
    """The bytes of prepared image payloads that requests in flight hold, by request id, against ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def check_room(self) -> None:
        """Overloaded when the budget is spent already (before encoding anything)."""
        if self.held and self.total >= self.limit:
            raise Overloaded(self._full())

    def take(self, request_id: str, payload: Any) -> int:
        """Count ``payload`` for ``request_id``; Overloaded when it does not fit beside what is held now,
        ValueError when it could never fit. Returns its bytes."""
        size = nbytes(payload)
        if size > self.limit:
            raise ValueError(
                f"images: their features take {size} bytes, more than a worker holds for requests in flight "
                f"(DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES={self.limit})"
            )
        if self.total + size > self.limit:
            raise Overloaded(self._full(size))
        self.held[request_id] = size
        return size

    def release(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def clear(self) -> None:
        self.held.clear()

    def _full(self, size: int = 0) -> str:
        need = f" (this request's: {size} bytes)" if size else ""
        return (
            f"images: the image features of {len(self.held)} request(s) in flight hold {self.total} of this worker's "
            f"{self.limit} bytes (DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES){need}; retry later"
        )


__all__ = ["FeatureBudget", "FeatureCache", "nbytes"]
