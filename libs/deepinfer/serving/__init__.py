"""What the services share to serve over gRPC: the server plumbing (:mod:`.server`: ``serve``, health, drain, the
credentials), errors and their status codes, health checks, Prometheus metrics, tracing, NATS presence, and the
worker servicer that both worker services (NVIDIA, Ascend) run (:mod:`.worker`).

Each service's own code lives in its package under ``services/`` (``services/balancer``, ``services/scheduler``,
``services/kvstore``, ``services/grammar``, ``services/worker_nvidia``, ``services/worker_ascend``).
"""
