"""A resume point's kvstore key, derived from (model fingerprint, cache salt, tokens) and bound to its blob; and the
one-way names KV events use instead of keys or tokens.

Every hash is BLAKE2b (16-byte digests, a distinct ``person`` per use); never Python's ``hash()``::

    root   = H(fingerprint, cache salt)                   engine.prefix_cache.root_hash
    chain  = h_k, the chain over the k full pages          engine.prefix_cache.page_hashes (h_0 = root)
    tail   = H_tail(chain, tokens after the last page)     tail_digest
    key    = H_key(fingerprint, chain, tail, position)     resume_key: the blob's kvstore key
    anchor = H_anchor(chain)                               anchor: what a KV event indexes a resume point under
    tag    = H_tag(fingerprint, key)                       key_tag: what a KV event names a blob by

Contracts:

- **Bound keys.** A resume-point Put carries ``chain``, ``tail`` (hex) and ``position`` in its meta (the blob's
  header, :func:`binding_meta`); the kvstore recomputes the key from them and refuses the blob when it differs
  (:func:`check_binding`). A blob copied under another prompt's key is refused: forging a header that derives the
  victim's key takes the victim's chain and tail, i.e. its tokens and cache salt.
- **Events carry no key and no token.** A KV event names a blob by its tag and indexes it under its anchor, both
  one-way: a reader of events learns neither the key (so cannot Get the blob) nor the chain (so cannot test
  guesses of the tail's tokens). A scheduler matches events by recomputing chain, tail, key and tag from a
  request's own tokens and salt (:class:`~deepinfer.engine.remote_index.RemoteIndex`).
- Blob meta holds digests and the position only, never token ids.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

from deepinfer.kvstore.blob import BlobKey, BlobRefused

__all__ = [
    "BINDING_FIELDS",
    "DIGEST_BYTES",
    "anchor",
    "binding_meta",
    "check_binding",
    "key_tag",
    "parse_binding",
    "resume_key",
    "tail_digest",
]

DIGEST_BYTES = 16
BINDING_FIELDS = ("chain", "tail", "position")


def _h(person: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=person)
    for part in parts:
        h.update(struct.pack("<I", len(part)))  # length-prefixed: no two part lists hash alike
        h.update(part)
    return h.digest()


def tail_digest(chain: bytes, tail: Sequence[int]) -> bytes:
    """The digest of the tokens after the last full page (fewer than a page), chained to ``chain``."""
    return _h(b"deepinfer-tail", chain, struct.pack(f"<{len(tail)}q", *tail))


def resume_key(fingerprint: str, chain: bytes, tail: bytes, position: int) -> bytes:
    """The kvstore key of a resume point (``tail`` is :func:`tail_digest`)."""
    return _h(b"deepinfer-rpkey", fingerprint.encode(), chain, tail, struct.pack("<Q", position))


def anchor(chain: bytes) -> bytes:
    """The one-way index a KV event files a resume point under (a scheduler computes it from its own chain)."""
    return _h(b"deepinfer-anchor", chain)


def key_tag(fingerprint: str, key: bytes) -> bytes:
    """The one-way name of a blob in KV events."""
    return _h(b"deepinfer-kvtag", fingerprint.encode(), key)


def binding_meta(chain: bytes, tail: bytes, position: int) -> dict[str, str]:
    """The meta a resume point's Put carries, from which the kvstore recomputes its key."""
    return {"chain": chain.hex(), "tail": tail.hex(), "position": str(position)}


def parse_binding(meta: Mapping[str, str]) -> tuple[bytes, bytes, int] | None:
    """``(chain, tail, position)`` from a blob's meta, or ``None`` when they are missing or malformed."""
    try:
        chain, tail, position = bytes.fromhex(meta["chain"]), bytes.fromhex(meta["tail"]), int(meta["position"])
    except (KeyError, ValueError, TypeError):
        return None
    if len(chain) != DIGEST_BYTES or len(tail) != DIGEST_BYTES or position <= 0:
        return None
    return chain, tail, position


def check_binding(key: BlobKey, meta: Mapping[str, str]) -> None:
    """``BlobRefused`` (``unbound_key`` / ``key_mismatch``) unless a resume point's key is the one its meta
    derives. Other blobs (``resume_point`` false: never resumed from) are not checked."""
    if not key.resume_point:
        return
    binding = parse_binding(meta)
    if binding is None:
        raise BlobRefused(
            "unbound_key", "meta: a resume point must carry chain and tail (16-byte hex digests) and position"
        )
    if resume_key(key.fingerprint, *binding) != key.hash:
        raise BlobRefused("key_mismatch", "key.hash: not the key the blob's own header (chain, tail, position) derives")
