"""DeepSeek-V4 as the engine serves it (``engine.model_api.ModelFamily``): its config, model and checkpoint
loader, its step graphs (``step_graphs``: attached to the model it builds), its paged cache, per-sequence state,
resume points (``resume_format``) and step batches. DeepSeek-V4.1 (``deepseek_v41.family``) shares the cache, state,
resume points and batches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.models.deepseek_v4 import resume_format
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import set_w8a8, uses_w8a8
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState, StateSnapshot
from deepinfer.quant.w4a8 import set_w4a8, uses_w4a8
from deepinfer.runtime.decode_graphs import BUCKETS
from deepinfer.runtime.step_graphs import StepGraphs


class DeepseekV4Family:
    model_type = "deepseek_v4"
    resume_layout = resume_format.LAYOUT
    decode_buckets: Sequence[int] = BUCKETS

    def parse_config(self, raw: dict) -> DeepseekV4Config:
        return DeepseekV4Config.from_dict(raw)

    def step_graphs(self) -> StepGraphs:
        """The runtime's graphs for this family's model (``runtime.step_graphs``): ``graphs.DecodeGraphs`` for decode
        steps, ``verify_graphs.VerifyGraphs`` for verify steps on the decode path and
        ``draft_graphs`` for the MTP drafter's loop and observe pass, ``prefill_graphs.PrefillGraphs``
        for the others; ``build`` attaches them (``model.step_graphs``), and so does whoever builds the model by hand
        and wants its steps graphed."""
        from deepinfer.models.deepseek_v4.draft_graphs import DraftGraphs, ObserveGraphs
        from deepinfer.models.deepseek_v4.graphs import DecodeGraphs
        from deepinfer.models.deepseek_v4.prefill_graphs import PrefillGraphs
        from deepinfer.models.deepseek_v4.verify_graphs import VerifyGraphs

        return StepGraphs(DecodeGraphs, PrefillGraphs, VerifyGraphs, DraftGraphs, ObserveGraphs)

    def build(
        self,
        path: Path,
        config: DeepseekV4Config,
        ops: object,
        dtype: torch.dtype,
        device: torch.device,
        quant_sim: bool | None,
        ep: object = None,
    ) -> torch.nn.Module:
        """``quant_sim``: the official quantisation points are simulated only when asked (``DEEPINFER_QUANT_SIM``
        when None). ``ep``: the MoE layers sharded for expert parallelism before loading
        (``parallel.expert_parallel.shard_model``), and the attention's heads for tensor parallelism where its
        ``tp`` group has several ranks (``parallel.tensor_parallel.shard_heads``). With ``ops.native_weights`` the
        FP8 linears and MXFP4 experts stay in their stored formats (``quant.native``), then ``ops.prepare_weights``
        arranges them for its kernels.
        The model gets the family's ``step_graphs`` (used where ``ops`` allows graphs)."""
        from deepinfer.checkpoint.loader import load_checkpoint
        from deepinfer.models.deepseek_v4.model import DeepseekV4Model
        from deepinfer.parallel.expert_parallel import shard_model
        from deepinfer.parallel.tensor_parallel import shard_heads
        from deepinfer.quant.native import prepare_native

        net = DeepseekV4Model(config, ops)
        net.step_graphs = self.step_graphs()
        shard_heads(net, getattr(ep, "tp", None))  # (tensor parallelism: this rank's heads, before any format)
        if getattr(ops, "native_weights", False):
            prepare_native(net, tuple(config.weight_block_size), quantize=False)
        if ep is not None:
            shard_model(net, ep)
        net.cp = getattr(ep, "cp", None)  # context parallelism: a step's tokens split over the group
        load_checkpoint(net, path, dtype=dtype)
        net.to(device)
        sim = envs.DEEPINFER_QUANT_SIM if quant_sim is None else quant_sim
        set_w8a8(net, envs.DEEPINFER_W8A8)
        set_w4a8(net, envs.DEEPINFER_W4A8)
        net.set_quant_sim(sim)  # before prepare_weights, which joins projections of equal activation roundings
        ops.prepare_weights(net)
        return net

    def new_cache(
        self, config: object, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> PagedKVCache:
        return PagedKVCache(config, num_pages, page_size, dtype, device)

    def new_state(self) -> SequenceState:
        return SequenceState()

    def take_snapshot(
        self, state: SequenceState, cache: PagedKVCache, block_table: torch.Tensor, compact: bool
    ) -> StateSnapshot:
        return StateSnapshot.take(state, cache, block_table, compact=compact)

    def encode_resume(self, snapshot: StateSnapshot, pages: resume_format.Pages) -> bytes:
        return resume_format.encode(snapshot, pages)

    def decode_resume(self, data: bytes) -> tuple[StateSnapshot, resume_format.Pages]:
        return resume_format.decode(data)

    def batch(
        self,
        chunks: Sequence[tuple[SequenceState, int, int, torch.Tensor, int | None]],
        token_ids: list[list[int]],
        device: torch.device | str,
        mm: Sequence[object | None] | None = None,
    ) -> ForwardBatch:
        if mm is not None and any(m is not None for m in mm):
            self.image_encoder(None)  # refuses
        return ForwardBatch.build([SeqChunk(*c) for c in chunks], token_ids, device=device)

    def speculator(self, model: torch.nn.Module, max_drafts: int, proposer: object | None = None) -> object:
        """Speculative decoding with the model's MTP block (``speculator.MTPSpeculator``; ValueError without one). It
        drafts a fixed count: no confidence for ``DEEPINFER_ENABLE_MTP_VARLEN``."""
        from deepinfer.models.deepseek_v4.speculator import MTPSpeculator

        if envs.DEEPINFER_ENABLE_MTP_VARLEN:
            raise ValueError(
                f"DEEPINFER_ENABLE_MTP_VARLEN: {self.model_type}'s MTP block has no confidence head to choose draft "
                "lengths by; unset it (every sequence verifies DEEPINFER_USE_NEXTN_DECODE drafts)"
            )
        return MTPSpeculator(model, max_drafts, proposer)

    def image_encoder(self, model: object) -> object:
        raise ValueError(f"images: {self.model_type} takes no image input")

    def prepare_images(
        self, config: object, encoder: object, token_ids: list[int], images: Sequence[bytes]
    ) -> tuple[list[int], list[tuple[int, int]], object]:
        raise ValueError(f"images: {self.model_type} takes no image input")

    def fingerprint_facts(self, model: torch.nn.Module) -> list[str]:
        facts = []
        if uses_w8a8(model):  # FP8 activations in the linears (DEEPINFER_W8A8)
            facts.append("w8a8")
        if uses_w4a8(model):  # FP8 activations in the routed experts (DEEPINFER_W4A8)
            facts.append("w4a8")
        return facts


FAMILY = DeepseekV4Family()
