"""The kvstore service: prefix-cache resume points as checksummed blobs in host memory and on local disk.

- :mod:`.store`: :class:`~.store.Store`, the two tiers with LRU capacity and retention, without transport;
  :mod:`.disk`: the disk tier's file format (atomic writes, header and payload checksums);
- :mod:`.events` (batched KV events on NATS) and :mod:`.metrics` (Prometheus);
- :mod:`.service`: the gRPC servicer and ``run_kvstore``; ``python -m services.kvstore`` parses its flags.

What clients share with it (blob keys, chunk assembly, the client) is :mod:`deepinfer.kvstore`.
"""
