"""NVIDIA worker service: weights and KV state on one GPU, executing steps.

Its core is :class:`deepinfer.engine.worker.ModelRunner` on the ``nvidia`` op backend; the gRPC adapter lands
with the service-mesh issue, the Triton kernels with the NVIDIA-backend issue.
"""
