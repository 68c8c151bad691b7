"""DeepSeek-V4.1 as the engine serves it (``engine.model_api.ModelFamily``): its own config, model and loader
(the Engram token map from the checkpoint's tokenizer); V4's paged cache, sequence state, resume points and step
batches (``deepseek_v4.family``). Its cache formats (FP8 window, FP4 compressed rows and index keys;
docs/deepseek_v41.md ("Cache formats")) are part of the released model and stay on unless ``quant_sim`` is False,
and a prompt chunk may run the decoder layers on its tail only (``decoder_from``: ``DEEPINFER_DECODER_REPLAY_TOKENS``,
which changes the decoder layers' window state resume points hold, so it joins the fingerprint). Image prompts
(``image_input``): the built-in encoder is the checkpoint's vision tower, and a step whose chunks cover image spans
is an ``ImageBatch``, whose embeddings the model splices at prefill."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.models.deepseek_v4.family import DeepseekV4Family
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import set_w8a8
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41.config import MODEL_TYPE, DeepseekV41Config
from deepinfer.models.deepseek_v41.image_input import BuiltinImageEncoder, ImageBatch, ImagePrompt, prepare_image_prompt
from deepinfer.quant.w4a8 import set_w4a8
from deepinfer.runtime.step_graphs import StepGraphs


def shared_tables(net: torch.nn.Module, dtype: torch.dtype, ep: Any) -> dict[str, tuple[torch.Tensor, bool]]:
    """The Engram tables of a rank of several on one host, in host memory the ranks share
    (``runtime.shared_host``, named by the group's ``host_key``): rank 0 fills them, the others map them (the
    loader's ``shared``)."""
    from deepinfer.checkpoint.names_v41 import keeps_fp32
    from deepinfer.runtime import shared_host

    names = [f"layers.{i}.engram.embed.weight" for i, b in enumerate(net.layers) if b.engram is not None]
    specs = {n: (tuple(net.get_parameter(n).shape), torch.float32 if keeps_fp32(n) else dtype) for n in names}
    fill = ep.rank == 0
    if fill:
        shared_host.check_room(sum(torch.Size(sh).numel() * d.itemsize for sh, d in specs.values()))
    return {n: (shared_host.tensor(ep.host_key, n, sh, d), fill) for n, (sh, d) in specs.items()}


class DeepseekV41Family(DeepseekV4Family):
    model_type = MODEL_TYPE

    def parse_config(self, raw: dict) -> DeepseekV41Config:
        return DeepseekV41Config.from_dict(raw)

    def step_graphs(self) -> StepGraphs:
        """V4.1's graphs (``deepseek_v41.graphs.DecodeGraphs``, ``deepseek_v41.prefill_graphs.PrefillGraphs``, the
        verify steps' ``deepseek_v41.verify_graphs.VerifyGraphs``, DSpark's draft and keep passes'
        ``dspark_graphs.DSparkGraphs`` and ``KeepGraphs``)."""
        from deepinfer.models.deepseek_v41.dspark_graphs import DSparkGraphs, KeepGraphs
        from deepinfer.models.deepseek_v41.graphs import DecodeGraphs
        from deepinfer.models.deepseek_v41.prefill_graphs import PrefillGraphs
        from deepinfer.models.deepseek_v41.verify_graphs import VerifyGraphs

        return StepGraphs(DecodeGraphs, PrefillGraphs, VerifyGraphs, DSparkGraphs, KeepGraphs)

    def build(
        self,
        path: Path,
        config: DeepseekV41Config,
        ops: object,
        dtype: torch.dtype,
        device: torch.device,
        quant_sim: bool | None,
        ep: object = None,
    ) -> torch.nn.Module:
        from deepinfer.checkpoint.engram_vocab import engram_token_map_of
        from deepinfer.checkpoint.loader_v41 import load_v41_checkpoint
        from deepinfer.models.deepseek_v41.model import DeepseekV41Model
        from deepinfer.parallel.expert_parallel import shard_model
        from deepinfer.parallel.tensor_parallel import shard_heads
        from deepinfer.quant.native import prepare_native

        has_engram = bool(config.text_config.engram_layer_ids)
        token_map = engram_token_map_of(path)[0] if has_engram else None
        with torch.device("meta"):  # nothing allocated until the loader fills it (Flash: 552B parameters)
            net = DeepseekV41Model(config, ops, token_map)
            net.step_graphs = self.step_graphs()
            shard_heads(net, getattr(ep, "tp", None))  # (tensor parallelism: this rank's heads, before any format)
            if getattr(ops, "native_weights", False):
                prepare_native(net, tuple(config.weight_block_size), quantize=False)
            if ep is not None:  # (expert parallelism: each MoE layer this rank's experts only)
                shard_model(net, ep)
            net.cp = getattr(ep, "cp", None)  # context parallelism: a step's tokens split over the group
        host_tables = envs.DEEPINFER_ENGRAM_TABLES == "host"
        shared = shared_tables(net, dtype, ep) if host_tables and ep is not None and ep.a2a.size > 1 else {}
        load_v41_checkpoint(net, path, dtype, shared=shared)
        tables = [b.engram.embed.weight for b in net.layers if b.engram is not None]
        host = [w.data for w in tables] if host_tables else []
        for w in tables if host else ():  # (kept out of the move: the released tables do not fit a device)
            w.data = w.data.new_empty(0)
        net.to(device)
        for w, data in zip(tables, host):
            w.data = data
        if host:
            net.place_engram_tables("cpu", shared=bool(shared))
        set_w8a8(net, envs.DEEPINFER_W8A8)  # before prepare_weights: projections join only with equal roundings
        set_w4a8(net, envs.DEEPINFER_W4A8)  # before prepare_weights: W4A8 experts keep their codes as stored
        ops.prepare_weights(net)
        net.set_quant_sim(quant_sim is not False)
        return net

    def speculator(self, model: torch.nn.Module, max_drafts: int, proposer: object | None = None) -> object:
        """Speculative decoding with the DSpark stages (``speculator.DSparkSpeculator``; ValueError without them),
        confidence-scheduled lengths with ``DEEPINFER_ENABLE_MTP_VARLEN``."""
        from deepinfer.models.deepseek_v41.speculator import DSparkSpeculator

        return DSparkSpeculator(
            model, max_drafts, proposer, envs.DEEPINFER_ENABLE_MTP_VARLEN, envs.DEEPINFER_SPEC_DECODE_MIN_SURVIVAL
        )

    def image_encoder(self, model: torch.nn.Module) -> BuiltinImageEncoder:
        return BuiltinImageEncoder(model)

    def prepare_images(
        self, config: DeepseekV41Config, encoder: object, token_ids: list[int], images: Sequence[bytes]
    ) -> tuple[list[int], list[tuple[int, int]], ImagePrompt]:
        return prepare_image_prompt(config, encoder, token_ids, images)

    def batch(
        self,
        chunks: Sequence[tuple[SequenceState, int, int, torch.Tensor, int | None]],
        token_ids: list[list[int]],
        device: torch.device | str,
        mm: Sequence[Any] | None = None,
    ) -> ForwardBatch:
        """V4's batch; with images, an :class:`ImageBatch` whose chunks carry their slice of the image spans (the
        model splices the features in: ``image_input.chunk_embeddings``)."""
        if mm is None or all(m is None for m in mm):
            return super().batch(chunks, token_ids, device)
        batch = ImageBatch.build([SeqChunk(*c) for c in chunks], token_ids, device=device)
        batch.images = tuple(
            (a, c[1], c[2], m.data) for (a, _), c, m in zip(batch.offsets(), chunks, mm) if m is not None
        )
        if not all(isinstance(p, ImagePrompt) for *_, p in batch.images):
            raise ValueError("mm: a DeepSeek-V4.1 image payload (image_input.ImagePrompt) is required")
        return batch

    def fingerprint_facts(self, model: torch.nn.Module) -> list[str]:
        replay = envs.DEEPINFER_DECODER_REPLAY_TOKENS
        return ([f"decoder_replay={replay}"] if replay else []) + super().fingerprint_facts(model)


FAMILY = DeepseekV41Family()
