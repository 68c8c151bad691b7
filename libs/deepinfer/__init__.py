"""deepinfer: a serving system for DeepSeek's V4 family.

``from deepinfer import LLM, SamplingParams`` is the offline API; the services under ``services/``
wrap the same engine core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    if name == "LLM":  # imported lazily: it pulls in torch and the model
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(name)
