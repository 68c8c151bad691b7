"""The scheduler service: one engine replica (admission, batching, pages, preemption, the step pipeline) driving its
worker over gRPC.

- :mod:`.servicer`: the ``deepinfer.v1.Scheduler`` servicer over the engine's scheduler
  (:class:`deepinfer.engine.scheduler.Scheduler`);
- :mod:`.remote_worker`: the worker's ``Step`` stream (and its loss); :mod:`.kv_index`: what the kvstores and this
  replica hold, from and to the KV events on NATS;
- :mod:`.main`: ``run_scheduler``, the service put together; ``python -m services.scheduler`` parses its flags.
"""
