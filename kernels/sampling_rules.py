"""The rules every sampler shares: the torch one (``deepinfer.engine.sampler``) and the kernels' (``kernels.sampling``).
The standard library only, so importing it costs nothing (no torch, no Triton)."""

TOP_P_EPS = 1e-6  # top-p's tolerance at the boundary: a token is kept while the mass before it is below p - TOP_P_EPS

__all__ = ["TOP_P_EPS"]
