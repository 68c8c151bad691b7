"""The KV cache system below the device (ARCHITECTURE.md §3): content-addressed blobs (resume points) in
host memory and on local disk, checksummed, retained for a configured time, announced on NATS.

- :mod:`.blob`: :class:`BlobKey`, :class:`Blob`, the per-blob checks and the store's errors.
- :mod:`.disk`: the file format of the disk tier (atomic writes, header + payload checksums).
- :mod:`.store`: :class:`Store`, the two tiers with LRU capacity and retention, without transport.
- :mod:`.assembly`: Put streams of chunks back into blobs, and blobs into Get chunks.
- :mod:`.metrics`, :mod:`.events`: Prometheus metrics and batched KV events on NATS.
- :mod:`.service`: the gRPC servicer and ``run_kvstore`` (``python -m services.kvstore``).
- :mod:`.client`: :class:`KVStoreClient`, the asyncio client.
"""

from deepinfer.kvstore.blob import Blob, BlobKey, BlobNotFound, BlobRefused, CorruptBlob, Tier
from deepinfer.kvstore.store import Store, StoreEvent

__all__ = ["Blob", "BlobKey", "BlobNotFound", "BlobRefused", "CorruptBlob", "Store", "StoreEvent", "Tier"]
