"""Balancer service: public gRPC/OpenAI API, tokenization, chat encoding, routing across replicas.

Lands with the service-mesh issue; the chat encoding it uses is :mod:`deepinfer.chat`.
"""
