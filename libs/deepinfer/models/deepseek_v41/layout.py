"""Per-layer typing of DeepSeek-V4.1, derived from the raw config lists (docs/deepseek_v41.md ("Layer roles (SWA, Full,
Reindex, Reuse)")).

Kinds: ``swa`` (ratio 0, window attention only, main RoPE), ``full`` (in ``kv_source_layer_ids``: owns the
compressor and the index keys, computes a new top-k), ``reindex`` (index source, not KV source: new top-k over
its owner's index keys), ``reuse`` (ratio != 0, neither: the owner's compressed KV and the latest top-k).
Every ratio != 0 layer (ratio 1 included) uses the compress RoPE. DSpark stages are appended after the
backbone layers (``mtp.0..``), SWA-only. Nothing here looks at V4's ``ratio > 1`` logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig

LayerKind = Literal["swa", "full", "reindex", "reuse"]
Stage = Literal["encoder", "decoder", "draft"]


@dataclass(frozen=True)
class LayerSpec:
    index: int  # backbone layer id; DSpark stage k is num_hidden_layers + k
    ratio: int  # CSA2 compression ratio: 0, 1 or 2
    kind: LayerKind
    kv_source: int | None  # the Full layer whose compressed KV (and index keys) this layer reads
    topk_source: int | None  # the Full/Reindex layer whose top-k selection this layer attends with
    candidate_source: bool  # picks the candidate blocks later index sources are restricted to
    uses_candidates: bool  # an index source restricted to the candidate source's blocks
    engram: bool  # Engram memory added to the streams before this layer's attention mHC
    stage: Stage  # CED half (layers < num_hidden_layers // 2 encode) or a DSpark draft stage

    @property
    def is_draft(self) -> bool:
        return self.stage == "draft"

    @property
    def compress_rope(self) -> bool:
        """Q, window KV, compressed KV and index Q/K use the compress RoPE (θ=compress_rope_theta + YaRN)."""
        return self.ratio != 0

    @property
    def is_index_source(self) -> bool:
        return self.kind in ("full", "reindex")


def layer_specs(c: DeepseekV41TextConfig) -> tuple[LayerSpec, ...]:
    """One spec per backbone layer, then one per DSpark stage."""
    n = c.num_hidden_layers
    kv_src, idx_src = set(c.kv_source_layer_ids), set(c.index_source_layer_ids)
    engram = {i for i in c.engram_layer_ids if i < n}
    cand = c.candidate_source_layer_id
    owner: int | None = None  # latest Full layer (the config guarantees consumers share its ratio)
    selector: int | None = None  # latest index source
    specs = []
    for i in range(n + c.num_nextn_predict_layers):
        ratio = c.compress_ratios[i]
        stage: Stage = "draft" if i >= n else "encoder" if i < n // 2 else "decoder"
        if ratio == 0:
            kind: LayerKind = "swa"
        elif i in kv_src:
            kind, owner = "full", i
        elif i in idx_src:
            kind = "reindex"
        else:
            kind = "reuse"
        if kind in ("full", "reindex"):
            selector = i
        specs.append(
            LayerSpec(
                index=i,
                ratio=ratio,
                kind=kind,
                kv_source=owner if ratio else None,
                topk_source=selector if ratio else None,
                candidate_source=ratio != 0 and i == cand,
                uses_candidates=kind in ("full", "reindex") and 0 <= cand < i,
                engram=i in engram,
                stage=stage,
            )
        )
    return tuple(specs)


def encoder_layers(c: DeepseekV41TextConfig) -> range:
    """The CED encoder half (layers 0 .. num_hidden_layers // 2 - 1); [UNCONFIRMED] no explicit config key."""
    return range(c.num_hidden_layers // 2)
