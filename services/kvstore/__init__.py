"""KV store service: content-addressed KV pages in host memory and on disk (lands with the KV-cache issue)."""
