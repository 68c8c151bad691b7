"""The settings the nvidia backend's Triton kernels follow. ``deepinfer.kernels`` imports nothing of the engine, so no
kernel reads a setting itself: the backend hands them over, into the kernel modules' knobs, once ``get_ops("nvidia")``
has made its op set (``hand_over``). An op set made directly (``NvidiaOps()``: tests, benchmarks) leaves the knobs as
they are: the settings' defaults, unless something handed the settings over."""

from __future__ import annotations


def hand_over() -> None:
    """Read the kernels' settings (a bad value is an error here) into their knobs: ``DEEPINFER_PDL`` →
    ``kernels.pdl.configure`` (every launch), ``DEEPINFER_MOE_PREFILL`` → ``kernels.moe_mxfp4_wgmma.PREFILL`` (the
    MXFP4 experts' prefill kernels), ``DEEPINFER_ATTN_PREFILL`` → ``kernels.attention_wgmma.ENABLED`` (the sparse
    attention's wide tiles in Gluon)."""
    from deepinfer import envs
    from deepinfer.kernels import attention_wgmma, moe_mxfp4_wgmma, pdl

    pdl.configure(bool(envs.get("DEEPINFER_PDL")))
    moe_mxfp4_wgmma.PREFILL = envs.get("DEEPINFER_MOE_PREFILL")
    attention_wgmma.ENABLED = envs.get("DEEPINFER_ATTN_PREFILL") == "gluon"


__all__ = ["hand_over"]
