"""KV store service: prefix-cache resume points as checksummed blobs in host memory and on disk."""
