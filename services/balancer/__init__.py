"""The balancer service: the public API (OpenAI-compatible HTTP and ``deepinfer.v1.Generation`` over gRPC) in front of
the scheduler replicas.

- :mod:`.core`: :class:`~.core.Balancer`, the logic without a front end: admission, routing, the relay of each
  request from its replica and its move to another one when that replica fails, the replicas' loads and facts;
- :mod:`.servicer` (gRPC) and :mod:`.http` with :mod:`.openai_protocol` (the OpenAI API): the two front ends;
- :mod:`.prompt` (text, token ids, or a chat rendered with the chat encoding), :mod:`.admission`, :mod:`.relay`,
  :mod:`.replicas`, :mod:`.discovery` (replicas registered on NATS), :mod:`.constraints` (grammars through the
  grammar service);
- :mod:`.main`: ``run_balancer``, the service put together; ``python -m services.balancer`` parses its flags.
"""
