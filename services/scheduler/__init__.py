"""Scheduler service: one engine replica (admission, batching, pages, preemption, the step pipeline).

Its core is :class:`deepinfer.engine.scheduler.Scheduler`; the gRPC adapter lands with the service-mesh issue.
"""
