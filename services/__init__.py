"""The deepinfer services: one package per process, each started as ``python -m services.<name>``."""
