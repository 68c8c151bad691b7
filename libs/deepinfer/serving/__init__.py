"""The gRPC servicers of the deepinfer services and the server plumbing they share.

Each servicer is a thin adapter over a core class without transport (the engine's scheduler, the
worker runtime); the service packages under ``services/`` only parse flags and call ``serve``.
"""
