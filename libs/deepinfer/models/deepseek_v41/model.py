"""DeepSeek-V4.1 (V4.1-Flash) text backbone in plain PyTorch over the ops interface (docs/deepseek_v41.md).

``forward`` runs one step of several sequences (each a chunk of new tokens, prefill or decode) and returns the
trunk output ``[T, hidden]`` (the streams collapsed with the last FFN ``pre``, before the final norm); ``logits``
applies the final norm and the head in fp32 to the rows asked for. Per layer (``block.Block``): Engram
(layers in ``engram_layer_ids``) into all streams, then the lagged mHC around CSA2 attention and the modality-aware
MoE; the encoder/decoder split is ``decoder_split``.

Per-sequence state lives in the engine's :class:`SequenceState` (window rings, the ratio-2 owners' pending half
group, the last ``max_ngram_size - 1`` token ids for Engram) and the paged cache (the owners' compressed rows and
index keys). Nothing here knows about scheduling, transport or kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from deepinfer.models.deepseek_v4 import verify_split
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.layers import Linear, RMSNorm, RotaryTable, embedding
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state_pool import StatePool, use_pool
from deepinfer.models.deepseek_v4.verify_step import PooledVerify
from deepinfer.models.deepseek_v41 import verify_step
from deepinfer.models.deepseek_v41.attention import Attention, SharedKVAttention
from deepinfer.models.deepseek_v41.block import Block
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.context_split import split_forward
from deepinfer.models.deepseek_v41.decoder_split import decoder_context, split_at_decoder
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter
from deepinfer.models.deepseek_v41.engram import BLOCKED, EngramHasher
from deepinfer.models.deepseek_v41.image import ImageFeatures, PreprocessedImage, splice_image_embeddings
from deepinfer.models.deepseek_v41.image_input import ImageBatch, chunk_embeddings
from deepinfer.models.deepseek_v41.layout import layer_specs
from deepinfer.models.deepseek_v41.mhc import embed_streams, final_collapse, initial_pre
from deepinfer.models.deepseek_v41.step_context import StepContext
from deepinfer.models.deepseek_v41.vision import VisionAligner, VisionTransformer
from deepinfer.ops import Ops, get_ops
from deepinfer.parallel.context_parallel import ContextParallel, splits
from deepinfer.runtime.host_copy import to_device
from deepinfer.runtime.platform import platform_of

if TYPE_CHECKING:
    from deepinfer.runtime.step_graphs import StepGraphs

SHORT_CHUNK = 8  # ``_engram_rows`` hashes steps of chunks this short token by token, batched over the chunks


class DeepseekV41Model(nn.Module):
    """The V4.1 backbone. ``engram_token_map`` is the tokenizer's compressed vocabulary
    (``engram.compressed_token_map``): required when the config has Engram layers."""

    verify_on_decode_path = True  # speculative verify steps may run as decode sub-steps (verify_step.py)
    # their attention in one call over every sub-step's rows (verify_attention.py), else in turns (the default until
    # the H200 has measured it: the GPU runs the sub-steps' tests of record)
    verify_fused = False

    def verify_forward(
        self, batch: ForwardBatch, cache: PagedKVCache | None, verified: list[int], pad: int = 0, capture: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, PooledVerify] | None:
        """A speculative verify step on the decode path (``verify_step.pooled_forward``: the trunk output, with
        ``capture`` DSpark's features, the rollback), or None where that path does not take ``batch``
        (``verify_step.eligible``: the caller runs the ragged path, ``deepseek_v4.speculative``). A step whose prompt
        chunks the path cannot hold runs them as a plain step beside it (``deepseek_v4.verify_split``)."""
        if verify_step.eligible(self, batch):
            return verify_step.pooled_forward(self, batch, cache, verified, pad, capture)
        mixed = verify_split.split(self, batch, verified)
        if mixed is None or not verify_step.eligible(self, mixed.verify):
            return None
        rest = self(mixed.rest, cache, capture=capture)
        self.split_steps += 1
        rest_features = self.dspark_features if capture else None
        y, feats, pending = verify_step.pooled_forward(self, mixed.verify, cache, mixed.verified, pad, capture)
        return mixed.merge(y, rest), mixed.merge(feats, rest_features), mixed.adopt(pending)

    def __init__(
        self, config: DeepseekV41Config, ops: Ops | None = None, engram_token_map: Sequence[int] | None = None
    ) -> None:
        super().__init__()
        self.config = config
        c = self.text = config.text_config
        self.ops = ops or get_ops("cpu")
        self.specs = layer_specs(c)
        n = c.num_hidden_layers
        self.embed = embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Block(c, s) for s in self.specs[:n]])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, c.vocab_size)
        self.rope_main = RotaryTable(c.qk_rope_head_dim, c.rope_theta, None)
        self.rope_compress = RotaryTable(c.qk_rope_head_dim, c.compress_rope_theta, c.rope_scaling)
        self.hasher = None
        if any(s.engram for s in self.specs[:n]):
            if engram_token_map is None:
                raise ValueError(
                    "this DeepSeek-V4.1 config has Engram layers: pass engram_token_map (the tokenizer's compressed "
                    "vocabulary, deepinfer.models.deepseek_v41.engram.compressed_token_map)"
                )
            with torch.device("cpu"):  # the hash runs on host token ids: its tables stay on the host whatever the
                self.hasher = EngramHasher(c, engram_token_map)  # default device (no copy of them per sequence)
        self.mtp = None  # the DSpark stages (released mtp.{k}.*); ``self.dspark`` drafts with them
        if c.num_nextn_predict_layers > 0:
            drafter = DSparkDrafter(c)
            object.__setattr__(self, "dspark", drafter)  # not a submodule: its stages are registered as ``mtp``
            self.mtp = drafter.mtp
        # the runtime's choice of graphs for a step (runtime.step_graphs.StepGraphs, attached by the family's build or
        # family.step_graphs(); None: every step eager); it makes and keeps the graphs here on the first step that may
        # use them (graphs.DecodeGraphs, prefill_graphs.PrefillGraphs)
        self.step_graphs: StepGraphs | None = None
        self.decode_graphs: Any = None
        self.prefill_graphs: Any = None
        # piecewise prefill graphs (DEEPINFER_PREFILL_GRAPHS; tests/kernels/test_prefill_graphs_v41.py, H200 2026-12-02)
        self.piecewise_prefill = True
        self.pooled_decode = True  # decode steps on a StatePool: decode_step.py (the decode graphs need it)
        self.state_pool: StatePool | None = None
        self.cp: ContextParallel | None = None  # this rank's context-parallel group (``parallel.context_parallel``)
        self.split_steps = 0  # verify steps run as two forwards (``verify_split``; a rank group counts forwards)
        self._pool_given: StatePool | None = None  # the pool the attention layers hold
        self.vision = self.aligner = None
        if config.vision_config.num_hidden_layers > 0:  # released names: vision.*, aligner.*, image_{start,...}
            self.vision = VisionTransformer(config.vision_config, torch.float32)
            self.aligner = VisionAligner(config.vision_config, c.hidden_size, torch.float32)
            for name in ("image_start", "image_end", "image_newline"):
                self.register_parameter(name, nn.Parameter(torch.zeros(c.hidden_size), requires_grad=False))

    @torch.no_grad()
    def encode_image(self, image: PreprocessedImage) -> ImageFeatures:
        """The built-in vision tower and aligner on one preprocessed image (``image.preprocess_image``)."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (vision_config.num_hidden_layers is 0)")
        x = self.vision(image.patches.to(self.vision.patch_embed.proj.weight.device), image.vit_h, image.vit_w)
        return ImageFeatures(image.llm_h, image.llm_w, self.aligner(x, image.vit_h, image.vit_w))

    @torch.no_grad()
    def input_embeddings(
        self, token_ids: torch.Tensor, types: torch.Tensor | None, features: Sequence[ImageFeatures]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings with image spans filled in: ``types [T]`` are the ``vision_token_types`` of the expanded
        ids (``image.expand_image_placeholders``), ``features`` one :class:`ImageFeatures` per span (from any vision
        encoder). Returns ``(embeds [T, hidden], image_mask [T] or None)`` for :class:`ForwardBatch`."""
        x = self.embed(token_ids)
        if types is None or not bool((types >= 0).any()):
            if features:
                raise ValueError(f"{len(features)} image feature set(s) given but the tokens hold no image span")
            return x, None
        if not hasattr(self, "image_start"):
            raise ValueError("this checkpoint has no vision embeddings (vision_config.num_hidden_layers is 0)")
        bad = (types >= 0) & (token_ids != self.config.image_token_id)
        if bool(bad.any()):
            raise ValueError(f"image-span positions must carry image_token_id {self.config.image_token_id}")
        x = splice_image_embeddings(x, types, features, self.image_start, self.image_newline, self.image_end)
        return x, types >= 0

    def place_engram_tables(self, device: torch.device | str, shared: bool = False) -> None:
        """Keep the Engram tables on ``device`` (e.g. host memory: ~200 GB in the released model) whatever device
        the rest of the model is on; lookups gather there and move only the rows read. Call after ``.to()``. Host
        tables are pinned where the model's platform copies from pinned memory: ``shared`` ones (host memory other
        processes map: ``runtime.shared_host``) in place, others into pinned copies."""
        dev = torch.device(device)
        platform = platform_of(self.head.weight.device)
        pin = dev.type == "cpu" and platform.pinned_copies
        for layer in self.layers:
            if layer.engram is not None:
                w = layer.engram.embed.weight
                if shared:
                    if pin:
                        platform.pin_in_place(w.data)
                    continue
                w.data = w.data.to(dev)
                if pin:
                    w.data = w.data.pin_memory()

    def set_quant_sim(self, enabled: bool) -> None:
        """The cache representations (docs/deepseek_v41.md ("Cache formats"): FP8 window KV, NVFP4 compressed rows,
        MXFP4 index keys and queries); on by default: the released model computes through them."""
        for m in self.modules():
            if isinstance(m, SharedKVAttention):  # the DSpark stages' window KV too
                m.quant_sim = enabled

    def rope_of(self, layer: Block) -> RotaryTable:
        """The rotary table of a layer (compressed layers use the compress flavour)."""
        return self.rope_compress if layer.spec.compress_rope else self.rope_main

    def _engram_rows(self, batch: ForwardBatch, device: torch.device | None = None) -> torch.Tensor | None:
        """Row ids ``[T, engram layers, hashes]`` of the step's tokens (on ``device``, default the tokens' device);
        advances each sequence's token history."""
        if self.hasher is None:
            return None
        ids = batch.host_token_ids if batch.host_token_ids is not None else batch.token_ids.cpu()
        text = None if batch.image_mask is None else ~batch.image_mask.cpu()
        dev = batch.token_ids.device if device is None else device
        if max(c.length for c in batch.chunks) <= SHORT_CHUNK:  # decode and verify steps: token by token, batched
            return to_device(self._engram_short(batch.chunks, ids, text), dev)
        out, o = [], 0
        for c in batch.chunks:
            seq = ids[o : o + c.length]
            mask = None if text is None else text[o : o + c.length]
            hist = torch.tensor(list(c.state.history) or [], dtype=torch.long)
            hist = torch.cat([self.hasher.empty_history(), hist])[-self.hasher.history_len :]
            out.append(self.hasher.hash(seq, mask, hist))
            c.state.history = tuple(self.hasher.next_history(hist, seq, mask).tolist())
            o += c.length
        return to_device(torch.cat(out), dev)

    def _engram_short(self, chunks: list[SeqChunk], ids: torch.Tensor, text: torch.Tensor | None) -> torch.Tensor:
        """``_engram_rows`` of short chunks (a decode step's one token per sequence, a verify step's token and drafts):
        the histories stacked ``[B, h]`` (left-padded with the empty history), then per token index one
        ``EngramHasher.step`` over the chunks that have that token (numpy on the host: ``hash`` and
        ``next_history``'s integer ops, row by row; one call for a decode step)."""
        h = self.hasher.history_len
        empty = [BLOCKED] * h
        hist = np.array([(empty + list(c.state.history))[-h:] for c in chunks], dtype=np.int64).reshape(-1, h)
        lengths = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.cumsum(lengths) - lengths
        flat, mask = ids.numpy().reshape(-1), None if text is None else text.numpy().reshape(-1)
        out = None
        for j in range(int(lengths.max())):
            live = np.nonzero(lengths > j)[0]
            at = starts[live] + j
            rows, hist[live] = self.hasher.step(flat[at], hist[live], None if mask is None else mask[at])
            if out is None:
                out = np.empty((flat.shape[0], *rows.shape[1:]), dtype=rows.dtype)
            out[at] = rows
        for c, row in zip(chunks, hist.tolist()):
            c.state.history = tuple(row)
        return torch.from_numpy(out)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache | None, capture: bool = False) -> torch.Tensor:
        """Run the backbone on ``batch``; returns the trunk output ``[T, hidden]`` (before the final norm). With
        ``capture``, ``self.dspark_features`` holds the DSpark target features ``[T, L·hidden]`` of the step (the
        stream means entering ``dspark_target_layer_ids``; zeros on rows a bounded decoder replay skipped).

        Encoder/decoder split (docs/deepseek_v41.md ("Encoder/decoder split and bounded decoder replay")): a chunk with
        ``decoder_from`` runs the decoder layers only on positions ``>= decoder_from`` (rows before it get zeros); the
        first decoder layer still publishes its compressed rows and index keys for every position, so the decoder's
        long-range memory is complete.

        With ``step_graphs`` attached the step may replay CUDA graphs, as the runtime decides (``runtime.step_graphs``:
        a decode step ``graphs.DecodeGraphs``, the whole step, one graph per batch bucket and context span; other text
        steps piecewise ``prefill_graphs.PrefillGraphs`` unless ``piecewise_prefill`` is off), with eager results;
        with ``capture`` only a decode step (its graphs compute the features too)."""
        ops, c = self.ops, self.text
        if isinstance(batch, ImageBatch) and batch.images and batch.input_embeds is None:  # an image prompt's chunks
            batch.input_embeds, batch.image_mask = chunk_embeddings(self, batch)
        self._use_pool(not ops.invariant_by_sequence and self.pooled_decode)
        y = None if self.step_graphs is None else self._replay(batch, cache, capture)
        if y is not None:  # replayed from graphs (None: run eagerly)
            for chunk in batch.chunks:
                chunk.state.num_tokens = chunk.end
            return y
        if not capture and splits(self, batch):  # context parallelism: this rank's tokens, every token's state
            y = split_forward(self, batch, cache, self.cp)
            for chunk in batch.chunks:
                chunk.state.num_tokens = chunk.end
            return y
        x = self.embed(batch.token_ids) if batch.input_embeds is None else batch.input_embeds
        h = embed_streams(x, c.hc_mult)
        pre = initial_pre(x.shape[0], c.hc_mult, x.device)
        rows = self._engram_rows(batch)
        image = batch.image_mask
        ctx = StepContext(batch.chunks, batch.offsets(), batch.positions, cache)
        active = None  # rows of the batch the decoder runs on (None: all)
        targets = set(c.dspark_target_layer_ids) if capture else set()
        captured: list[torch.Tensor] = []
        for layer in self.layers:
            rope = self.rope_of(layer)
            if layer.spec.index == self.decoder_start and any(ch.decoder_from is not None for ch in ctx.chunks):
                active = split_at_decoder(layer, self.specs, h, pre, ctx, rows, image, rope, ops)
                if active is not None and active.numel() == 0:  # no chunk reaches its decoder part yet
                    break
                if active is not None:
                    h, pre, rows = h[active], pre[active], None if rows is None else rows[active]
                    image = None if image is None else image[active]
                    ctx = decoder_context(ctx, active)
            e_rows = None if layer.engram is None else rows[:, layer.engram.slot]
            cap = captured if layer.spec.index in targets else None
            h, pre = layer(h, pre, ctx, rope, ops, e_rows, None if image is None else ~image, image, cap)
        for chunk in batch.chunks:
            chunk.state.num_tokens = chunk.end
        if capture:
            self._keep_features(captured, active, batch.token_ids.shape[0])
        if active is None:
            return final_collapse(h, pre, ops)
        y = final_collapse(h, pre, ops) if active.numel() else h[:0, 0]
        return y.new_zeros(batch.token_ids.shape[0], y.shape[-1]).index_copy_(0, active, y)

    def _replay(self, batch: ForwardBatch, cache: PagedKVCache | None, capture: bool) -> torch.Tensor | None:
        """The step replayed from the graphs ``step_graphs`` picks, or None: run it eagerly. With ``capture`` only
        the decode graphs, which compute DSpark's features too (``graphs.DecodeGraphs.features``)."""
        if not capture:
            return self.step_graphs.run(self, batch, cache)
        graphs = self.step_graphs.of(self, "decode")
        y = None if graphs is None or self.mtp is None else graphs.run(batch, cache)
        if y is not None:
            self.dspark_features = graphs.features.clone()
        return y

    def _use_pool(self, on: bool) -> None:
        """Give every attention layer the model's ``StatePool`` (made on the weights' device), or none."""
        use_pool(self, on, Attention)

    def _keep_features(self, captured: list[torch.Tensor], active: torch.Tensor | None, n: int) -> None:
        if self.mtp is None:
            raise ValueError("this checkpoint has no DSpark stages (num_nextn_predict_layers is 0)")
        if len(captured) != len(self.text.dspark_target_layer_ids):  # the decoder never ran this step
            self.dspark_features = torch.zeros(n, self.dspark.feature_dim, device=self.embed.weight.device)
            return
        f = self.dspark.target_features(captured)
        if active is not None:
            f = f.new_zeros(n, f.shape[-1]).index_copy_(0, active, f)
        self.dspark_features = f

    @property
    def decoder_start(self) -> int:
        """The first decoder layer (CED: layers ``num_hidden_layers // 2 ..``)."""
        return self.text.num_hidden_layers // 2

    @torch.no_grad()
    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[T', vocab]`` of trunk outputs ``[T', hidden]``."""
        return self.ops.logits_linear(self.norm(y, self.ops), self.head.weight)
