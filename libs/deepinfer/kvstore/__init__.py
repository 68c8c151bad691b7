"""The KV cache system's shared side: what the kvstore service and its clients (schedulers, workers) both use.

Content-addressed blobs (resume points) kept in host memory and on local disk by the kvstore service
(``services/kvstore``: its store, disk tier, events and servicer), checksummed and retained for a configured time.

- :mod:`.blob`: :class:`BlobKey`, :class:`Blob`, the per-blob checks and the store's errors.
- :mod:`.keys`: the content keys of resume points (what the engine's prefix cache and the store agree on).
- :mod:`.assembly`: Put streams of chunks back into blobs, and blobs into Get chunks.
- :mod:`.client`: :class:`KVStoreClient`, the asyncio client; :mod:`.remote`: the engine's resume store over it.
"""

from deepinfer.kvstore.blob import Blob, BlobKey, BlobNotFound, BlobRefused, CorruptBlob, Tier

__all__ = ["Blob", "BlobKey", "BlobNotFound", "BlobRefused", "CorruptBlob", "Tier"]
