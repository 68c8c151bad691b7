"""Checkpoints saved without the multi-token-prediction block (docs/deepseek_v4.md ("Checkpoint layouts")).

transformers' ``DeepseekV4ForCausalLM`` builds no MTP layer, and NeMo AutoModel's ``DeepseekV41ForCausalLM`` keeps
its DSpark stages apart: what either saves has no ``mtp.*`` tensor. Such a checkpoint still serves; the model just
cannot draft. The loaders treat a checkpoint that holds *no* ``mtp.*`` tensor at all as one without the block: they
log a warning and take the block out of the model, which then looks like one built from a config with
``num_nextn_predict_layers: 0`` (V4: ``model.mtp`` an empty ``ModuleList``; V4.1: ``model.mtp`` None, no
``model.dspark``). :func:`has_mtp` reads that. A block that is there in part, and any other missing tensor, stays an
error naming the tensors.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from deepinfer.telemetry import get_logger

log = get_logger(__name__)

MTP_PREFIX = "mtp."


def has_mtp(model: nn.Module) -> bool:
    """True when ``model`` holds MTP (V4) / DSpark (V4.1) stages it can draft with."""
    return bool(getattr(model, "mtp", None))


def split_missing(missing: list[str]) -> tuple[list[str], list[str]]:
    """(MTP tensors, other tensors) of a list of missing checkpoint names."""
    mtp = [n for n in missing if n.startswith(MTP_PREFIX)]
    return mtp, [n for n in missing if not n.startswith(MTP_PREFIX)]


def drop_mtp(model: nn.Module, path: Path, n_missing: int) -> None:
    """Take the MTP block out of ``model`` (the checkpoint at ``path`` has none of its ``n_missing`` tensors) and
    log why: the model then serves without speculative decoding."""
    stages = len(model.mtp) if model.mtp is not None else 0
    if isinstance(model.mtp, nn.ModuleList) and hasattr(model, "dspark"):  # V4.1: the DSpark drafter
        model.mtp = None
        model.__dict__.pop("dspark", None)
    else:
        model.mtp = nn.ModuleList()
    log.warning(
        "checkpoint has no MTP block: speculative decoding is off for this model",
        path=str(path),
        mtp_stages=stages,
        missing_tensors=n_missing,
    )
