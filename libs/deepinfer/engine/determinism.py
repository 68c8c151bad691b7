"""What a worker guarantees about repeatable results, and what that guarantee depends on.

Reported by ``GetWorkerInfo`` / ``GetReplicaInfo`` / ``GetModelInfo`` and by ``LLM.determinism``;
docs/determinism.md explains each item.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the balancer merges reports without importing torch
    import torch

    from deepinfer.ops import Ops

INVARIANT_COVERS = (
    "batch composition: a sequence's logits do not depend on the other sequences of a step",
    "position: nor on where the sequence sits in the step",
    "chunked prefill: nor on how its prompt is cut into chunks",
    "resumed state: nor on whether its earlier tokens were computed in this step, an earlier one, or "
    "again after a preemption",
)
SAMPLING_COVERS = (
    "seeded sampling: a request with a seed draws its noise from (seed, position), so the same input tokens, "
    "logits and sampling parameters give the same tokens on any run",
)


@dataclass
class Determinism:
    batch_invariant: bool
    deterministic_sampling: bool = True
    covers: list[str] = field(default_factory=list)
    requires: dict[str, str] = field(default_factory=dict)  # what must be equal for results to repeat

    def to_dict(self) -> dict[str, object]:
        return {
            "batch_invariant": self.batch_invariant,
            "deterministic_sampling": self.deterministic_sampling,
            "covers": list(self.covers),
            "requires": dict(self.requires),
        }


def _device_name(accelerator: str) -> str:
    from deepinfer.runtime.platform import platform_for

    return platform_for(accelerator).device_name()  # the host's processor where no such device is visible


def describe(ops: Ops, accelerator: str, dtype: torch.dtype, world_size: int = 1, tp: int = 1) -> Determinism:
    """The guarantee of a worker running ``ops`` (one of a group of ``world_size`` expert-parallel ranks, its
    attention's heads split over ``tp`` of them)."""
    import torch

    requires = {
        "accelerator": accelerator,
        "device": _device_name(accelerator),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "expert_parallel_size": str(world_size),
        "tensor_parallel_size": str(tp),
    }
    if ops.batch_invariant:
        requires["ops"] = ops.invariance  # the op set's reduction orders, by name and the constants that fix them
        if accelerator == "cpu":
            requires["intra_op_threads"] = str(torch.get_num_threads())
        else:
            import triton

            requires["triton"] = triton.__version__
        covers = [*INVARIANT_COVERS, *SAMPLING_COVERS]
    else:
        requires["ops"] = "default"
        covers = [SAMPLING_COVERS[0] + " — given identical logits, which without batch invariance also needs "
                  "the same batch composition"]  # fmt: skip
    return Determinism(ops.batch_invariant, True, covers, requires)


def merge(replicas: list[Determinism]) -> Determinism:
    """The guarantee of a service whose requests may land on any of ``replicas``: theirs when they agree,
    otherwise not batch-invariant, naming what differs."""
    if not replicas:
        return Determinism(False, True, ["no replica reported"], {})
    first = replicas[0]
    differ = {k for r in replicas for k in {*r.requires, *first.requires} if r.requires.get(k) != first.requires.get(k)}
    if any(r.batch_invariant != first.batch_invariant for r in replicas):
        differ.add("batch_invariant")
    if not differ:
        return Determinism(first.batch_invariant, first.deterministic_sampling, first.covers[:], dict(first.requires))
    note = f"replicas differ in {', '.join(sorted(differ))}: results depend on the replica a request lands on"
    return Determinism(False, all(r.deterministic_sampling for r in replicas), [note], dict(first.requires))
