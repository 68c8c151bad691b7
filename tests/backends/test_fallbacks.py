"""No backend inherits the reference silently (issue 35): an op set outside ``backends/reference/`` declares in one
place (``FROM_REFERENCE``) the ops of :class:`deepinfer.ops.Ops` it takes from the reference op set as they are, and
implements every other op itself (in its class or a mixin of its own folder). The checks run on the classes: no
device, no Triton needed."""

from __future__ import annotations

import pytest

from deepinfer.backends.ascend import AscendOps
from deepinfer.backends.nvidia import NvidiaOps
from deepinfer.ops import LAYERS, Ops, op_names

# every op set of a backend other than the reference, with the package its own code lives in
BACKEND_OPS = [
    (NvidiaOps, "deepinfer.backends.nvidia"),
    (AscendOps, "deepinfer.backends.ascend"),
]


def _owner(cls: type, name: str) -> type | None:
    """The class of ``cls``' MRO whose body defines ``name`` (what a call resolves to)."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _own(cls: type, package: str) -> frozenset[str]:
    """The ops of ``Ops`` that ``cls`` implements in its own backend's folder."""
    return frozenset(n for n in op_names(Ops) if (o := _owner(cls, n)) is not None and o.__module__.startswith(package))


def test_the_interface_is_the_union_of_its_layers() -> None:
    names = [n for layer in LAYERS for n in op_names(layer)]
    assert len(names) == len(set(names)), "an op belongs to one layer"
    assert set(names) == op_names(Ops) and len(names) == 36
    assert {"linear", "moe", "rms_norm", "rope", "topk_indices"} <= op_names(LAYERS[0])  # the model-agnostic core
    assert not {n for n in op_names(LAYERS[0]) if n.startswith(("hc_", "sparse_", "indexer_", "step_"))}


@pytest.mark.parametrize(("cls", "package"), BACKEND_OPS, ids=lambda v: getattr(v, "__name__", ""))
def test_every_op_is_the_backends_own_or_declared_from_the_reference(cls: type, package: str) -> None:
    declared = cls.__dict__.get("FROM_REFERENCE")
    assert isinstance(declared, frozenset), f"{cls.__name__} declares no FROM_REFERENCE of its own"
    own = _own(cls, package)
    unknown = sorted(declared - op_names(Ops))
    assert not unknown, f"{cls.__name__}.FROM_REFERENCE names ops the interface does not have: {unknown}"
    silent = sorted(op_names(Ops) - own - declared)
    assert not silent, f"{cls.__name__} inherits from the reference without listing them in FROM_REFERENCE: {silent}"
    both = sorted(own & declared)
    assert not both, f"{cls.__name__} lists in FROM_REFERENCE ops it implements itself: {both}"
    for name in declared:  # what it lists does come from the reference backend
        assert _owner(cls, name).__module__.startswith("deepinfer.backends.reference."), name


def test_the_check_catches_a_silent_inheritance_and_a_stale_entry() -> None:
    class Silent(AscendOps):  # noqa: D401 - a backend that dropped an entry
        FROM_REFERENCE = AscendOps.FROM_REFERENCE - {"rope"}

    class Stale(AscendOps):
        FROM_REFERENCE = AscendOps.FROM_REFERENCE

        def rope(self, *args: object, **kwargs: object) -> object:
            return super().rope(*args, **kwargs)

    Silent.__module__ = Stale.__module__ = "deepinfer.backends.ascend.test_double"
    for cls, message in ((Silent, "without listing them"), (Stale, "implements itself")):
        with pytest.raises(AssertionError, match=message):
            test_every_op_is_the_backends_own_or_declared_from_the_reference(cls, "deepinfer.backends.ascend")
