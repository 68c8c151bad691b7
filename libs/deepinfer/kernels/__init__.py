"""Triton kernels for the NVIDIA backend.

Nothing is imported here, so ``import deepinfer.kernels`` works on hosts without Triton; import the submodules
(``deepinfer.kernels.invariant``) where a kernel is needed. Each kernel is tested against the reference op it
replaces (``deepinfer.ops.reference``).
"""
