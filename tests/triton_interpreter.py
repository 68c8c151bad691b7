"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) on this project's NumPy.

Triton 3.6's interpreter turns a scalar kernel argument that bounds a ``range`` loop into
``int(np.array([v]))``, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python
scalars"); upstream Triton fixed it after 3.6. ``patch()`` makes ``__index__`` use ``.item()``.
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
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_deepinfer_patched", False):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._deepinfer_patched = True
    interpreter._patch_lang_tensor = patched
