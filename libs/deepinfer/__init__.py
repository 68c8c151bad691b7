"""deepinfer: a serving system for DeepSeek's V4 family.

``from deepinfer import LLM, SamplingParams`` is the offline API; the services under ``services/``
wrap the same engine core.
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from pathlib import Path
from typing import TYPE_CHECKING

# The Triton kernels live in the repository's top-level ``kernels/``; a wheel installs them inside this package as
# ``deepinfer.kernels`` (pyproject.toml's ``package-dir``). In a source checkout (``PYTHONPATH=libs``, or the editable
# install) this package is ``libs/deepinfer`` and the folder lies beside ``libs/``: a finder first on
# ``sys.meta_path`` answers for the one name ``deepinfer.kernels`` with that folder, whose submodules are then found
# through the package's ``__path__`` as usual. Nothing else of the repository's root becomes part of ``deepinfer``,
# and an installed wheel (no ``libs/`` above this file) is left alone.
_SOURCE_KERNELS = Path(__file__).resolve().parents[2] / "kernels"


class _SourceKernelsFinder:
    """``deepinfer.kernels`` in a source checkout (the comment above); every other name is not its business."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name != "deepinfer.kernels":
            return None
        init = _SOURCE_KERNELS / "__init__.py"
        return spec_from_file_location(name, init, submodule_search_locations=[str(_SOURCE_KERNELS)])


if (
    Path(__file__).resolve().parents[1].name == "libs"
    and (_SOURCE_KERNELS / "__init__.py").is_file()
    and not any(getattr(f, "__name__", None) == _SourceKernelsFinder.__name__ for f in sys.meta_path)
):
    sys.meta_path.insert(0, _SourceKernelsFinder)

from deepinfer.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from deepinfer.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    if name == "LLM":  # imported lazily: it pulls in torch and the model
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(name)
