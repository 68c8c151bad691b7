"""Load a DeepSeek-V4 safetensors checkpoint into :class:`DeepseekV4Model`.

Accepts official and transformers tensor names (its in-memory names and what its ``save_pretrained`` writes), FP8
e4m3 weights with UE8M0 block scales and MXFP4 routed experts (dequantised here, unless the model was switched to the
stored formats by ``quant.native.prepare_native``: then they are kept as stored, with their scales). Every problem
names the tensor and the file: a missing tensor, a wrong shape, an unreadable file. A checkpoint without any
``mtp.*`` tensor (what transformers saves) loads with a warning, its model without MTP (``checkpoint.mtp``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from deepinfer.checkpoint.mtp import MTP_PREFIX, drop_mtp, split_missing
from deepinfer.checkpoint.names import hf_to_official, internal_to_official, is_hf_name, official_to_internal
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.parallel.expert_parallel import ExpertSlots
from deepinfer.parallel.tensor_parallel import TensorShards
from deepinfer.quant.formats import dequantize_fp8_blocks, dequantize_mxfp4
from deepinfer.quant.native import is_fp8, is_mxfp4, logical_shape, unprepare


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, corrupt or has the wrong shape."""


# parameters the reference keeps in fp32 whatever the model dtype (mHC, ``ape``, sinks, router bias, norms;
# docs/deepseek_v4.md ("Tensors kept in bf16 or fp32"))
_FP32 = re.compile(r"(hc_\w+_(fn|base|scale)|\.ape|attn_sink|gate\.bias|norm\.weight)$")
# the compressors' projections run in fp32 (``ops.linear_fp32``) on values the checkpoint stores in bf16: loaded in
# the model dtype when it holds them exactly (a GPU multiplies them on the tensor cores with fp32 sums), else fp32
_FP32_IF_INEXACT = re.compile(r"compressor\.w(kv|gate)\.weight$")


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f.name} is listed in model.safetensors.index.json but missing from {path}")
    return files


_HF_STACKED = re.compile(r"^(.*\.ffn)\.experts\.(gate_up_proj|down_proj)$")


def _iter_tensors(files: list[Path], progress: bool, held: Callable[[str, int], bool],
                  shards: TensorShards | None = None, block: tuple[int, int] = (128, 128)
                  ) -> Iterator[tuple[str, torch.Tensor, Path]]:  # fmt: skip
    """Every tensor of ``files`` under its official name, transformers' stacked experts split per expert; the
    routed experts this process does not hold (``held(target, expert)`` false: an expert-parallel shard) are not
    read at all (a stacked tensor is read by the rows of its held experts), and a tensor-parallel shard's tensors
    (``shards``) only by the part it holds (FP8 weights by whole ``block`` s)."""
    bar = tqdm(files, desc="Loading safetensors checkpoint shards", disable=not progress, unit="shard")
    for file in bar:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = hf_to_official(key) if is_hf_name(key) else key
                    stacked = _HF_STACKED.match(name)
                    if stacked:
                        yield from _split_hf_experts(stacked, f.get_slice(key), held, file)
                        continue
                    target, expert = official_to_internal(_weight_name(name))
                    part = None
                    if expert is None and shards is not None and target in shards.shards:
                        part = shards.read(f.get_slice(key), target, name.endswith(".scale"), block)
                    if part is not None:
                        yield name, part, file
                    elif expert is None or held(target, expert):
                        yield name, f.get_tensor(key), file
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises plain exceptions for corrupt headers/data
            raise CheckpointError(f"cannot read {file.name}: {e}") from e


def _weight_name(name: str) -> str:
    """A scale tensor's weight (``….scale`` → ``….weight``): the name that says which expert it belongs to."""
    return name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name


def _split_hf_experts(m: re.Match, sl: Any, held: Callable[[str, int], bool], file: Path
                      ) -> Iterator[tuple[str, torch.Tensor, Path]]:  # fmt: skip
    """transformers stacks experts: gate_up_proj [E, 2I, D] and down_proj [E, D, I]; the rows of the held experts,
    one by one (``sl``: the tensor's safetensors slice)."""
    pre, shape = m.group(1), sl.get_shape()
    for e in range(shape[0]):
        if m.group(2) == "gate_up_proj":
            if held(f"{pre}.w1", e) or held(f"{pre}.w3", e):
                t = sl[e : e + 1][0]
                half = shape[1] // 2
                yield f"{pre}.experts.{e}.w1.weight", t[:half], file
                yield f"{pre}.experts.{e}.w3.weight", t[half:], file
        elif held(f"{pre}.w2", e):
            yield f"{pre}.experts.{e}.w2.weight", sl[e : e + 1][0], file


def load_checkpoint(
    model: DeepseekV4Model, path: str | Path, dtype: torch.dtype = torch.bfloat16, progress: bool = True
) -> None:
    """Fill every parameter and buffer of ``model`` from the checkpoint directory ``path``. A MoE sharded for expert
    parallelism (``parallel.expert_parallel.shard``) gets its slots' experts, and the others are never read."""
    path = Path(path)
    filler = _Filler(model, dtype)
    files = safetensors_files(path)
    for name, t, file in _iter_tensors(files, progress, filler.holds, filler.shards, filler.block):
        filler.add(name, t, file)
    filler.check_complete(path)


class _Filler:
    """The parameters and buffers of a model being filled, tensor by tensor: what is filled so far (routed experts
    one by one), and the quantised weights and scales that wait for each other."""

    def __init__(self, model: DeepseekV4Model, dtype: torch.dtype) -> None:
        params = dict(model.named_parameters())
        params.update(dict(model.named_buffers()))
        self.params = {k: v for k, v in params.items() if not k.startswith(("rope_",))}
        self.model, self.dtype = model, dtype
        self.filled: set[str] = set()
        self.saw_mtp = False  # the checkpoint holds some mtp.* tensor
        self.expert_filled: dict[str, set[int]] = {}
        self.pending: dict[str, tuple[torch.Tensor, Path]] = {}  # quantised weights waiting for their scale
        self.scales: dict[str, tuple[torch.Tensor, Path]] = {}
        self.n_experts = model.config.n_routed_experts
        self.block = tuple(model.config.weight_block_size)
        self.slots = ExpertSlots(model)  # where each routed expert goes (a sharded MoE: its slots only)
        self.holds = self.slots.holds
        self.shards = TensorShards(model)  # what a tensor-parallel shard holds of its attention's tensors

    def _slots(self, target: str, expert: int) -> list[int]:
        return self.slots.rows(target, expert, self.n_experts)

    def add(self, name: str, t: torch.Tensor, file: Path) -> None:
        """One checkpoint tensor (official name): placed, or kept until its weight / scale comes."""
        self.saw_mtp = self.saw_mtp or name.startswith(MTP_PREFIX)
        if name.endswith(".scale"):
            base = name[: -len(".scale")] + ".weight"
            self.scales[base] = (t, file)
            if base in self.pending:
                self.decode(base)
        elif t.dtype in (torch.float8_e4m3fn, torch.int8) and name.endswith(".weight"):
            self.pending[name] = (t, file)
            if name in self.scales:
                self.decode(name)
        else:
            self.place(name, t, file)

    def place(self, name: str, t: torch.Tensor, file: Path) -> None:
        """Store a (decoded) tensor in its parameter, cast to the model dtype or kept in fp32."""
        if name.startswith("mtp.") and re.match(r"^mtp\.\d+\.(embed|head)\.", name):
            return  # MTP copies of the shared embedding/head
        model, params, dtype, n_experts = self.model, self.params, self.dtype, self.n_experts
        target, expert = official_to_internal(name)
        p = params.get(target)
        if p is None:
            if re.match(r"^mtp\.(\d+)\.", name) and int(name.split(".")[1]) >= len(model.mtp):
                return  # more MTP stages than this model runs
            raise CheckpointError(f"unexpected tensor {name!r} in {file.name}")
        if is_fp8(p) or (is_mxfp4(p) and expert is not None):  # prepared for a format it is not stored in
            params.pop(unprepare(model, target), None)
            p.data = torch.empty(logical_shape(p), dtype=dtype, device=p.device)
        sh = self.shards.get(target) if expert is None else None
        if sh is not None:  # (an FP8 weight read by whole blocks, dequantised: this shard's part of it)
            t = sh.cut(t, self.block[sh.dim])
        want = p.shape[1:] if expert is not None else p.shape
        if tuple(t.shape) != tuple(want):
            raise CheckpointError(f"tensor {name!r} in {file.name} has shape {tuple(t.shape)}, expected {tuple(want)}")
        keep32 = p.dtype == torch.long or _FP32.search(target)
        if not keep32 and t.dtype == torch.float32 and _FP32_IF_INEXACT.search(target):
            keep32 = not torch.equal(t.to(dtype).to(t.dtype), t)
        value = t.to(p.dtype if p.dtype == torch.long else (torch.float32 if keep32 else dtype))
        with torch.no_grad():
            if expert is not None:
                if expert >= n_experts:
                    raise CheckpointError(f"tensor {name!r} in {file.name}: expert {expert} >= {n_experts}")
                if p.dtype != dtype:
                    p.data = torch.empty(p.shape, dtype=dtype)
                for slot in self._slots(target, expert):
                    p.data[slot] = value
                self.expert_filled.setdefault(target, set()).add(expert)
            else:
                p.data = value.contiguous()
                self.filled.add(target)

    def place_native(self, name: str, w: torch.Tensor, s: torch.Tensor, file: Path) -> bool:
        """A weight whose parameter was switched to the stored format (``quant.native.prepare_native``) is kept as
        stored, with its scales; False: decode it to the model dtype."""
        params, block, n_experts = self.params, self.block, self.n_experts
        target, expert = official_to_internal(name)
        p = params.get(target)
        if p is None:
            return False
        if is_fp8(p) and w.dtype == torch.float8_e4m3fn and expert is None:
            sh = self.shards.get(target)
            if sh is not None and not sh.aligned(block[sh.dim]):
                return False  # a shard that cuts a scale block: decoded (``TensorShards``)
            want = (-(-p.shape[0] // block[0]), -(-p.shape[1] // block[1]))
            if tuple(w.shape) != tuple(p.shape) or tuple(s.shape) != want:
                raise CheckpointError(
                    f"tensor {name!r} in {file.name} has shape {tuple(w.shape)} / scale {tuple(s.shape)}, expected "
                    f"{tuple(p.shape)} / {want}"
                )
            owner = target[: -len(".weight")]
            with torch.no_grad():
                p.data = w.contiguous()
                params[f"{owner}.scale"].data = s.float().contiguous()
            self.filled.update((target, f"{owner}.scale"))
            return True
        if is_mxfp4(p) and w.dtype == torch.int8 and expert is not None:
            sp = params[f"{target}_scale"]
            if tuple(w.shape) != tuple(p.shape[1:]) or tuple(s.shape) != tuple(sp.shape[1:]):
                raise CheckpointError(
                    f"tensor {name!r} in {file.name} has shape {tuple(w.shape)} / scale {tuple(s.shape)}, expected "
                    f"{tuple(p.shape[1:])} / {tuple(sp.shape[1:])}"
                )
            if expert >= n_experts:
                raise CheckpointError(f"tensor {name!r} in {file.name}: expert {expert} >= {n_experts}")
            with torch.no_grad():
                for slot in self._slots(target, expert):
                    p.data[slot] = w.view(p.dtype)
                    sp.data[slot] = s.view(torch.uint8)
            self.expert_filled.setdefault(target, set()).add(expert)
            self.filled.add(f"{target}_scale")
            return True
        return False

    def decode(self, name: str) -> None:
        """A quantised weight whose scale has come: kept as stored, or dequantised and placed."""
        (w, wf), (s, _) = self.pending.pop(name), self.scales.pop(name)
        if self.place_native(name, w, s, wf):
            return
        try:
            if w.dtype == torch.float8_e4m3fn:
                t = dequantize_fp8_blocks(w, s, block=self.block)
            else:
                t = dequantize_mxfp4(w, s)
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} in {wf.name}: {e}") from e
        self.place(name, t, wf)

    def check_complete(self, path: Path) -> None:
        """Raise unless every weight found its scale and every parameter was filled; a checkpoint without any MTP
        tensor takes the MTP block out of the model (``checkpoint.mtp``)."""
        for name, (_, file) in self.pending.items():
            raise CheckpointError(f"quantised tensor {name!r} in {file.name} has no scale tensor {name[:-7]}.scale")
        # reported under their checkpoint (official) names, routed experts one by one
        missing = [
            internal_to_official(k, e)
            for k in self.params
            if k not in self.filled
            for e in (self.slots.expected(k, self.n_experts) if re.match(r"^(.*\.ffn)\.(w[123])$", k) else [None])
            if e not in self.expert_filled.get(k, ())
        ]
        mtp, other = split_missing(missing)
        if mtp and not other and not self.saw_mtp:
            drop_mtp(self.model, path, len(mtp))
        elif missing:
            shown = other or missing  # the tensors that make it fail, before the MTP block
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {', '.join(shown[:5])}")
