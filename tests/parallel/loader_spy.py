"""What a checkpoint loader reads (``safe_open`` spied): the tensors read whole and those read as slices."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def spy_reads(monkeypatch: pytest.MonkeyPatch, loader: ModuleType) -> tuple[list[str], list[str]]:
    """Replace ``loader.safe_open`` by a spy; the keys it is then asked for whole and as slices, as they come."""
    whole: list[str] = []
    sliced: list[str] = []
    real = loader.safe_open

    class Spy:
        def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            self.f = real(*a, **k)

        def __enter__(self) -> Spy:
            self.f.__enter__()
            return self

        def __exit__(self, *a) -> None:  # noqa: ANN002
            self.f.__exit__(*a)

        def keys(self) -> list[str]:
            return self.f.keys()

        def get_tensor(self, key: str) -> torch.Tensor:
            whole.append(key)
            return self.f.get_tensor(key)

        def get_slice(self, key: str) -> object:
            sliced.append(key)
            return self.f.get_slice(key)

    monkeypatch.setattr(loader, "safe_open", Spy)
    return whole, sliced
