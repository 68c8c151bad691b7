"""Where the model runs: one platform per accelerator (its torch device type), and one folder per backend, each owning
its op set (an implementation of :class:`deepinfer.ops.Ops`).

The engine asks :func:`platform_for` for the platform (:class:`deepinfer.runtime.platform.Platform`) to place the
model and its state on, the runtime asks :func:`platform_of` a tensor's device for its streams, events, graphs and
host copies, and :func:`deepinfer.ops.get_ops` (the interface's one dispatch, importing a backend's folder only when
asked for it) gives the backend's ops; nothing else needs to know which accelerator it is, and no module outside a
backend's folder names a vendor's device API (tests/foundation/test_boundaries.py). The model code never imports
this package.

* ``cpu``: the reference op set (plain torch: the semantics every other backend is tested against) and its
  batch-invariant variant (:mod:`deepinfer.backends.reference`);
* ``nvidia``: ``torch.device("cuda")``, Triton kernels and CUDA graphs (:mod:`deepinfer.backends.nvidia`);
* ``ascend``: ``torch.device("npu")`` through torch_npu, the reference op set with torch_npu's fused ops where
  their semantics are the reference's (:mod:`deepinfer.backends.ascend`).

The backend folders do not import each other, except that ``nvidia`` and ``ascend`` build on the reference op set
(their op sets subclass ``ReferenceOps``; tests/foundation/test_boundaries.py checks it).
"""

from __future__ import annotations

from deepinfer.runtime.platform import ACCELERATORS, Platform, platform_for, platform_of

__all__ = ["ACCELERATORS", "Platform", "platform_for", "platform_of"]
