"""Non-text inputs (images) as the engine carries them, whatever the model.

A request's images are turned into prompt positions by its model family (``ModelFamily.prepare_images``: each image
placeholder expands into a span of positions whose token ids are all the placeholder id) and into the family's own
payload (the features its encoder made). The engine keeps, per request, a :class:`MultiModalInput`: the spans, a
digest of each image's bytes, and the payload, which it hands back to ``family.batch`` with every chunk that covers a
span, so a prompt may be prefilled in chunks that cut a span anywhere.

The prefix cache keys a prompt by its tokens; the span positions carry identical placeholder ids whatever the image,
so the cache keys them by :meth:`MultiModalInput.cache_tokens` instead: each span position becomes a negative key
taken from its image's digest (text ids are never negative), so two prompts share cached state up to the first
position where their tokens or their images differ, and no further.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DIGEST_BYTES = 32
_WORDS = DIGEST_BYTES // 8


def content_digest(data: bytes) -> bytes:
    """The digest of one item's bytes (blake2b, 32 bytes): what the prefix-cache keys of its span fold in."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=b"deepinfer-media").digest()


def _span_keys(digest: bytes) -> list[int]:
    """Four negative 62-bit keys from a digest; span position ``j`` takes key ``j % 4`` (so two consecutive positions
    of a span carry 124 bits of it, four carry all of it)."""
    words = [int.from_bytes(digest[8 * i : 8 * i + 8], "big") >> 2 for i in range(_WORDS)]
    return [-2 - w for w in words]


@dataclass(frozen=True)
class MultiModalInput:
    """A request's non-text items: ``spans[k]`` is the ``[start, end)`` range of prompt positions item ``k`` fills
    (ascending, disjoint), ``digests[k]`` its :func:`content_digest`; ``data`` is the model family's payload."""

    spans: tuple[tuple[int, int], ...]
    digests: tuple[bytes, ...]
    data: Any

    def __post_init__(self) -> None:
        if len(self.spans) != len(self.digests) or not self.spans:
            raise ValueError(f"multi_modal: {len(self.spans)} span(s) but {len(self.digests)} digest(s)")
        end = 0
        for a, b in self.spans:
            if type(a) is not int or type(b) is not int or not end <= a < b:
                raise ValueError(
                    f"multi_modal.spans: ascending, disjoint [start, end) ranges required, got {self.spans}"
                )
            end = b
        if any(not isinstance(d, bytes) or len(d) != DIGEST_BYTES for d in self.digests):
            raise ValueError(f"multi_modal.digests: {DIGEST_BYTES}-byte digests required")

    def check(self, num_prompt_tokens: int) -> None:
        """ValueError unless every span lies inside a prompt of ``num_prompt_tokens`` tokens."""
        if self.spans[-1][1] > num_prompt_tokens:
            raise ValueError(f"multi_modal.spans: a span ends at {self.spans[-1][1]}, past the prompt's "
                             f"{num_prompt_tokens} tokens")  # fmt: skip

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions ``[start, end)`` cover part of a span."""
        return any(a < end and start < b for a, b in self.spans)

    def expand_positions(self, positions: Sequence[int]) -> list[int]:
        """Positions of the prompt as sent (one placeholder per item) as positions of the expanded prompt: item ``k``'s
        placeholder became ``spans[k]``, so a position past it moves by the span's length minus one. A position is a
        boundary between tokens (a prefix length), so it never falls inside a span."""
        starts, shift = [], 0  # each placeholder's position in the prompt as sent, and the shift past it
        for a, b in self.spans:
            starts.append((a - shift, b - a - 1))
            shift += b - a - 1
        return [p + sum(grow for q, grow in starts if q < p) for p in positions]

    def cache_tokens(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` with each span position replaced by its image's key: what the prefix cache hashes."""
        out = list(prompt)
        for (a, b), digest in zip(self.spans, self.digests):
            keys = _span_keys(digest)
            out[a:b] = [keys[j % _WORDS] for j in range(b - a)]
        return out


def prepare_images(
    family: Any, config: Any, encoder: Any, token_ids: Sequence[int], images: Sequence[bytes]
) -> tuple[list[int], MultiModalInput]:
    """A prompt with images as the scheduler takes it: the family expands each placeholder of ``token_ids`` (one
    image per placeholder, in order) and encodes the images with ``encoder`` (``model_api.ImageEncoder``); the
    digests are taken here, from the bytes. ValueError (naming the field) for a mismatch or a model without images."""
    if not images:
        raise ValueError("multi_modal_data.image: at least one image is required")
    blobs = [bytes(b) for b in images]
    ids, spans, data = family.prepare_images(config, encoder, list(token_ids), blobs)
    if len(spans) != len(blobs):
        raise ValueError(f"multi_modal_data.image: {len(blobs)} image(s) but {len(spans)} span(s) were made")
    mm = MultiModalInput(tuple((int(a), int(b)) for a, b in spans), tuple(content_digest(b) for b in blobs), data)
    mm.check(len(ids))
    return ids, mm


__all__ = ["DIGEST_BYTES", "MultiModalInput", "content_digest", "prepare_images"]
