"""Load a DeepSeek-V4.1 checkpoint in the released format into any module with our parameter paths.

Reads ``model.safetensors.index.json`` shards or every ``*.safetensors`` file of a directory (or one file),
dequantizes FP8 e4m3 weights with UE8M0 32×32 block scales, MXFP4 routed experts (packed int8, per-row/32-column
UE8M0 scales) and FP8 Engram tables (per-row/32-column scales), stacks the routed experts and keeps in fp32 what the
reference keeps in fp32 (:func:`~deepinfer.checkpoint.names_v41.keeps_fp32`). Quantization is recognised from the
stored dtype, so an ``expert_dtype: fp8`` or bf16 conversion loads too.

Targets are ``model.state_dict()``'s keys (parameters and persistent buffers; derived buffers must be
non-persistent). Every problem names the tensor and the file: missing, unexpected, wrong shape, a weight without
its scale (or the reverse), an unreadable file. NeMo AutoModel's save (``DeepseekV41StateDictAdapter.to_hf``) writes
these names, unquantized and without the DSpark stages: a checkpoint without any ``mtp.*`` tensor loads with a
warning, its model without DSpark (``checkpoint.mtp``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from deepinfer.checkpoint.loader import CheckpointError
from deepinfer.checkpoint.mtp import MTP_PREFIX, drop_mtp, split_missing
from deepinfer.checkpoint.names_v41 import internal_to_released, is_stacked_expert, keeps_fp32, released_to_internal
from deepinfer.parallel.expert_parallel import ExpertSlots
from deepinfer.parallel.tensor_parallel import TensorShards
from deepinfer.quant.formats import dequantize_fp8_blocks, dequantize_mxfp4
from deepinfer.quant.native import is_fp8, is_mxfp4, logical_shape, unprepare

__all__ = ["CheckpointError", "checkpoint_files", "decode_tensor", "load_v41_checkpoint"]

_ROWWISE = re.compile(r"\.engram\.embed\.weight$")  # FP8 with per-row (not 32×32) scales


def checkpoint_files(path: str | Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a checkpoint and the index's ``weight_map`` (empty without an index)."""
    path = Path(path)
    if path.is_file():
        return [path], {}
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = dict(json.load(f)["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read {index.name} in {path}: {e}") from e
        files = [path / n for n in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f.name} is listed in {index.name} but missing from {path}")
        return files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files, {}


def _block_size(path: Path) -> tuple[int, int]:
    """Dense FP8 block size: ``quantization_config.weight_block_size`` of config.json, else V4.1's 32×32."""
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    try:
        with open(cfg, encoding="utf-8") as f:
            q = json.load(f).get("quantization_config") or {}
        block = q.get("weight_block_size") or (32, 32)
        return int(block[0]), int(block[1])
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return 32, 32


def decode_tensor(
    name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (32, 32)
) -> torch.Tensor:
    """Dequantize one released weight to fp32 (exact: every stored value times a power of two).

    ``int8`` = MXFP4 (``[rows, cols/2]``, scale ``[rows, cols/32]``); ``float8_e4m3fn`` = dense FP8 with ``block``
    scales, or per row and 32 columns for Engram tables. Raises ``ValueError`` on a scale/weight mismatch.
    """
    if weight.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"quantized weights and scales must be 2-D, got {tuple(weight.shape)} / {tuple(scale.shape)}")
    if weight.dtype == torch.int8:
        return dequantize_mxfp4(weight, scale)
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_blocks(weight, scale, block=(1, 32) if _ROWWISE.search(name) else block)
    raise ValueError(f"a tensor with a .scale must be float8_e4m3fn or int8 (packed FP4), got {weight.dtype}")


class _Reader:
    """Random access to the tensors of all shards: name → file, read on demand, errors naming tensor and file."""

    def __init__(self, files: list[Path], weight_map: dict[str, str], stack: ExitStack) -> None:
        self.where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
                keys = list(handle.keys())
            except Exception as e:  # safetensors raises plain exceptions for corrupt headers
                raise CheckpointError(f"cannot read {file.name}: {e}") from e
            self._handles[file] = handle
            for key in keys:
                if key in self.where:
                    raise CheckpointError(f"tensor {key!r} is stored twice: in {self.where[key].name} and {file.name}")
                self.where[key] = file
        for key, fname in weight_map.items():
            if key not in self.where or self.where[key].name != fname:
                raise CheckpointError(
                    f"tensor {key!r} is listed in model.safetensors.index.json for {fname} "
                    "but that file does not hold it"
                )

    def get(self, key: str, part: Callable[[Any], torch.Tensor | None] | None = None) -> torch.Tensor:
        """Tensor ``key``, or ``part`` of its safetensors slice where that gives one (a tensor-parallel shard)."""
        file = self.where[key]
        try:
            got = part(self._handles[file].get_slice(key)) if part is not None else None
            return got if got is not None else self._handles[file].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {key!r} from {file.name}: {e}") from e


def _device(ref: torch.Tensor) -> torch.device:
    """Where a loaded value goes: the target's device (CPU for a meta target)."""
    return torch.device("cpu") if ref.is_meta else ref.device


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter/buffer ``name`` by ``value`` (dtype may change; meta targets are materialised)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        if old is not None and not old.is_meta:
            old.data = value
        else:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _keep_native(
    model: nn.Module,
    target: str,
    expert: int | None,
    ref: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    experts: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
    rows: list[int] = (),
) -> list[str]:
    """Store a quantized tensor as it is when its target was switched to the stored format
    (``quant.native.prepare_native``; a routed expert's at its ``rows`` of the stacked target); returns the targets
    it filled ([] = decode it instead)."""
    dev = _device(ref)
    if is_fp8(ref) and weight.dtype == torch.float8_e4m3fn and expert is None:
        owner = target.removesuffix(".weight")
        want = (-(-ref.shape[0] // block[0]), -(-ref.shape[1] // block[1]))
        if tuple(weight.shape) != tuple(ref.shape) or tuple(scale.shape) != want:
            return []
        _set(model, target, weight.to(dev).contiguous())
        _set(model, f"{owner}.scale", scale.float().to(dev).contiguous())
        return [target, f"{owner}.scale"]
    if is_mxfp4(ref) and weight.dtype == torch.int8 and expert is not None:
        sref = targets[f"{target}_scale"]
        if tuple(weight.shape) != tuple(ref.shape[1:]) or tuple(scale.shape) != tuple(sref.shape[1:]):
            return []
        if not rows:
            return []  # the caller reports it
        for key, value, like in ((target, weight, ref), (f"{target}_scale", scale.view(torch.uint8), sref)):
            if key not in experts:
                experts[key] = torch.empty(tuple(like.shape), dtype=like.dtype, device=dev)
            for row in rows:
                experts[key][row] = value.view(like.dtype)
        return [f"{target}_scale"]
    return []


def load_v41_checkpoint(
    model: nn.Module,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    skip: Iterable[str] = (),
    progress: bool = False,
    shared: Mapping[str, tuple[torch.Tensor, bool]] | None = None,
) -> None:
    """Fill every parameter and persistent buffer of ``model`` from the released-format checkpoint at ``path``.

    ``path`` is a checkpoint directory (sharded with an index, or any ``*.safetensors``) or one file. Values are
    cast to ``dtype`` except the fp32 set of :func:`keeps_fp32` and integer targets. ``skip`` lists released-name
    prefixes to ignore (e.g. ``("mtp.",)`` for a model built without the DSpark drafter, ``("vision.", "aligner.",
    "image_")`` for a text-only one); anything else the module lacks is an error, and so is a target left unfilled,
    except a DSpark block the checkpoint has no tensor of (``checkpoint.mtp``: the model loses its ``mtp``).
    ``shared``: targets held in memory several processes share (``runtime.shared_host``), each ``(tensor, fill)``:
    the target becomes ``tensor``, which this process fills in place where ``fill`` is set and leaves to another
    process (not reading it) where not.
    """
    path = Path(path)
    skip = tuple(skip)
    files, weight_map = checkpoint_files(path)
    filler = _Filler(model, dtype, _block_size(path), shared or {})
    with ExitStack() as stack:
        reader = _Reader(files, weight_map, stack)
        names = sorted(k for k in reader.where if not k.endswith(".scale"))
        for key in reader.where:
            if key.endswith(".scale") and key.removesuffix(".scale") + ".weight" not in reader.where:
                if not key.startswith(skip):
                    raise CheckpointError(f"scale tensor {key!r} in {reader.where[key].name} has no weight")
        for name in tqdm(names, desc="Loading DeepSeek-V4.1 checkpoint", disable=not progress, unit="tensor"):
            if not name.startswith(skip):
                filler.load(reader, name)
        saw_mtp = any(k.startswith(MTP_PREFIX) for k in reader.where)
    filler.check_complete(path, saw_mtp)


class _Filler:
    """The targets of a model being filled, tensor by tensor: what is filled so far, and the stacked routed experts
    being assembled (set once all are read)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, block: tuple[int, int],
                 shared: Mapping[str, tuple[torch.Tensor, bool]]) -> None:  # fmt: skip
        self.model, self.dtype, self.block, self.shared = model, dtype, block, shared
        self.targets = dict(model.state_dict(keep_vars=True))
        self.filled: set[str] = set()
        self.experts: dict[str, torch.Tensor] = {}  # stacked target → the tensor being filled
        self.expert_rows: dict[str, set[int]] = {}
        self.slots = ExpertSlots(model)  # where each routed expert goes (a sharded MoE: its slots only)
        self.shards = TensorShards(model)  # what a tensor-parallel shard holds of its attention's tensors

    def _rows(self, target: str, expert: int, ref: torch.Tensor) -> list[int]:
        return self.slots.rows(target, expert, ref.shape[0])

    def load(self, reader: _Reader, name: str) -> None:
        """Read released tensor ``name`` (with its scale), decode it unless its target keeps the stored format, and
        store it."""
        file = reader.where[name].name
        target, expert = released_to_internal(name)
        ref = self.targets.get(target)
        if ref is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {file}: the model has no parameter {target!r}")
        if (expert is None) == is_stacked_expert(target):
            raise CheckpointError(f"tensor {name!r} in {file} does not match the layout of parameter {target!r}")
        if expert is not None and not self.slots.holds(target, expert):
            n = self.slots.experts(target, ref.shape[0])
            if expert >= n:
                raise CheckpointError(f"tensor {name!r} in {file}: expert {expert} >= {n} experts")
            return  # another rank's expert (expert parallelism): not read
        if target in self.shared and not self.shared[target][1]:
            _set(self.model, target, self.shared[target][0])  # another process fills it
            self.filled.add(target)
            return
        sh = self.shards.get(target) if expert is None else None
        t = reader.get(name, sh and (lambda sl: self.shards.read(sl, target, False, self.block)))
        scale_name = name.removesuffix(".weight") + ".scale"
        if name.endswith(".weight") and scale_name in reader.where:
            scale = reader.get(scale_name, sh and (lambda sl: self.shards.read(sl, target, True, self.block)))
            rows = [] if expert is None else self._rows(target, expert, ref)
            kept = _keep_native(self.model, target, expert, ref, t, scale, self.block, self.experts, self.targets, rows)
            if kept:
                self.filled.update(kept)
                if expert is not None:
                    self.expert_rows.setdefault(target, set()).add(expert)
                return
            try:
                t = decode_tensor(name, t, scale, self.block)
            except ValueError as e:
                raise CheckpointError(f"tensor {name!r} in {file}: {e}") from e
            if sh is not None:  # (read by whole blocks: this shard's part)
                t = sh.cut(t, self.block[sh.dim])
        elif t.dtype in (torch.float8_e4m3fn, torch.int8):
            raise CheckpointError(f"quantized tensor {name!r} in {file} has no scale tensor {scale_name!r}")
        self.store(name, file, target, expert, ref, t)

    def store(self, name: str, file: str, target: str, expert: int | None, ref: torch.Tensor, t: torch.Tensor) -> None:
        """Store the decoded value ``t`` of tensor ``name`` (from ``file``) in ``target`` (row ``expert`` of a stacked
        one), cast as the target keeps it."""
        shape = logical_shape(ref)
        want = shape[1:] if expert is not None else shape
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor {name!r} in {file} has shape {tuple(t.shape)}, expected {want}")
        if is_fp8(ref) or (is_mxfp4(ref) and expert is not None):  # prepared for a format it is not stored in
            self.filled.add(unprepare(self.model, target))
            out_dtype = self.dtype
        elif not ref.dtype.is_floating_point:
            out_dtype = ref.dtype
        else:
            out_dtype = torch.float32 if keeps_fp32(target) else self.dtype
        if expert is None:
            if target in self.shared:  # filled in place: the memory other processes map
                into = self.shared[target][0]
                if into.shape != t.shape or into.dtype != out_dtype:
                    raise CheckpointError(f"tensor {name!r} in {file}: shared as {into.dtype} {tuple(into.shape)}, "
                                          f"loads as {out_dtype} {tuple(t.shape)}")  # fmt: skip
                _set(self.model, target, into.copy_(t))
            else:
                _set(self.model, target, t.to(_device(ref), out_dtype).contiguous())
            self.filled.add(target)
            return
        rows = self._rows(target, expert, ref)
        if not rows:
            raise CheckpointError(f"tensor {name!r} in {file}: expert {expert} >= {ref.shape[0]} experts")
        if target not in self.experts:
            self.experts[target] = torch.empty(shape, dtype=out_dtype, device=_device(ref))
        for row in rows:
            self.experts[target][row] = t
        self.expert_rows.setdefault(target, set()).add(expert)

    def check_complete(self, path: Path, saw_mtp: bool) -> None:
        """Set the stacked experts; raise unless every target was filled (a DSpark block the checkpoint holds no
        tensor of, ``saw_mtp`` False, is taken out of the model instead)."""
        for target, value in self.experts.items():
            _set(self.model, target, value)
        missing = [
            internal_to_released(k, e)
            for k, ref in self.targets.items()
            if k not in self.filled
            for e in (self.slots.expected(k, ref.shape[0]) if is_stacked_expert(k) else [None])
            if e not in self.expert_rows.get(k, ())
        ]
        mtp, other = split_missing(missing)
        if mtp and not other and not saw_mtp:
            drop_mtp(self.model, path, len(mtp))
        elif missing:
            shown = other or missing  # the tensors that make it fail, before the DSpark block
            raise CheckpointError(
                f"checkpoint {path} lacks {len(missing)} tensors the model needs, e.g. {', '.join(shown[:5])}"
            )
