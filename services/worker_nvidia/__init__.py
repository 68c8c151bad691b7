"""The NVIDIA worker service: the model's weights and state on one GPU, running the scheduler's steps.

The worker servicer is shared with the Ascend worker (:mod:`deepinfer.serving.worker`); this service selects the
``nvidia`` backend (Triton kernels, CUDA graphs). ``python -m services.worker_nvidia``.
"""
