"""Triton kernels for the NVIDIA backend: the repository's top-level ``kernels/``, installed as ``deepinfer.kernels``.

Nothing is imported here, so ``import deepinfer.kernels`` works on hosts without Triton; import the submodules
(``deepinfer.kernels.invariant``) where a kernel is needed. No kernel module imports anything of the engine (only
``deepinfer.kernels``; ``tests/foundation/test_boundaries.py``): a setting is a module's knob that the backend sets
(``deepinfer.backends.nvidia.settings``). Each kernel is tested against the reference op it replaces
(``deepinfer.backends.reference``).
"""
