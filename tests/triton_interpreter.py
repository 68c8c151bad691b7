"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) on this project's NumPy.

Triton 3.6's interpreter turns a scalar kernel argument that bounds a ``range`` loop into
``int(np.array([v]))``, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python
scalars"); upstream Triton fixed it after 3.6. ``patch()`` makes ``__index__`` use ``.item()``.

The interpreter's ``tl.dot`` is ``np.matmul`` in the accumulator's dtype, and NumPy's float32 GEMM (OpenBLAS) rounds
an output element differently depending on where it sits in the tile on some CPUs (measured on an AMD EPYC host: the
same row and key, shifted within a 64-column tile, came out with other low bits in 158 of 200 trials). On a GPU an
element of an MMA is a function of its row and column only, and the kernels' bit-identity tests (one key scored in
two tiles, split against unsplit) rely on that. ``patch()`` therefore computes float32 dots in float64 (each product
of two float32 values exact) and rounds once to float32, so an element no longer depends on its neighbours.

Last, speed: the interpreter wraps every builtin of ``triton.language`` before each launch and unwraps it after;
``patch()`` wraps them once and leaves them wrapped (``_cache_builtins``).
"""

from __future__ import annotations

import os


def patch() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    _patch_dot(interpreter)
    _cache_builtins(interpreter)
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_deepinfer_patched", False):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._deepinfer_patched = True
    interpreter._patch_lang_tensor = patched


def _patch_dot(interpreter) -> None:  # noqa: ANN001
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_deepinfer_patched", False):
        return
    import numpy as np

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        out = d.data.dtype
        if out != np.float32 or a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._deepinfer_patched = True
    builder.create_dot = create_dot


def _cache_builtins(interpreter) -> None:  # noqa: ANN001
    """Each launch patches ``triton.language``'s builtins for the interpreter (a wrapper passing the interpreter's
    semantic), finding them with ``inspect.getmembers`` over the whole package, then restores them after the kernel:
    about 260 attributes set and reset per launch, a fifth of an interpreted test's time (measured on
    ``tests/kernels/test_pinning.py``). In a process that runs Triton only through the interpreter
    (``TRITON_INTERPRET=1``, where ``patch`` acts) the wrappers can stay: each package's builtins are wrapped once,
    at its first launch, with the same wrapper, and later launches find them wrapped."""
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "_deepinfer_patched", False) or not hasattr(interpreter, "_patch_attr"):
        return

    class _Permanent:  # a patch scope that keeps what it sets
        @staticmethod
        def set_attr(obj: object, name: str, value: object) -> None:
            setattr(obj, name, value)

    done: list[object] = []  # the packages wrapped (kept: an id could be reused)

    def patch_builtin(pkg, builder, *scope):  # noqa: ANN001, ANN002, ANN202
        if not any(p is pkg for p in done):
            original(pkg, builder, *([_Permanent()] if scope else []))
            done.append(pkg)

    patch_builtin._deepinfer_patched = True
    interpreter._patch_builtin = patch_builtin
