"""DeepSeek-V4.1 image input: preprocessing, placeholder expansion and embedding splice (docs/deepseek_v41.md
("Images")).

Matches NeMo AutoModel 0.7.0's ``DeepseekV41Processor`` / ``DeepseekV41Model._image_embeddings`` exactly:

* :func:`preprocess_image` — RGB, grid planning (``min_pixels`` upscale, multiples of ``patch_size``, the
  ``llm_h·(llm_w+1)+2 <= max_image_tokens`` shrink), ``ImageOps.pad`` with gray (127,127,127) (plain resize when
  ``width >= max_wh_ratio·height``), ``(x/255-0.5)/0.5`` -> bf16, row-major ``[vit_h·vit_w, 3, p, p]`` patches;
* :func:`expand_image_placeholders` — each ``image_token_id`` becomes ``[START] + ([IMG]×llm_w + [NEWLINE])×llm_h
  + [END]``, every position keeping ``image_token_id``, with ``vision_token_types`` -1/0/1/2/3;
* :func:`splice_image_embeddings` — image features into the type-1 positions (row-major), the learned
  ``image_start`` / ``image_newline`` / ``image_end`` vectors into the 0/2/3 positions.

:class:`ImageFeatures` is what a vision-encoder service hands the LM: ``(llm_h, llm_w, features)``; the LM side
owns delimiters, span expansion and the routing/Engram masks. Pillow is imported lazily (preprocessing only).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.models.deepseek_v41.config import DeepseekV41VisionConfig

if TYPE_CHECKING:
    from PIL import Image

TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3
PAD_COLOR = (127, 127, 127)


@dataclass(frozen=True)
class ImageGrid:
    """Resized pixel size (``width``×``height``), ViT patch grid and LM token grid of one image."""

    width: int
    height: int
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int


@dataclass(frozen=True)
class PreprocessedImage:
    """Patches ``[vit_h·vit_w, 3, p, p]`` (row-major) and the grids; ``llm_h·llm_w`` features will come out."""

    patches: torch.Tensor
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int


@dataclass(frozen=True)
class ImageFeatures:
    """One image's aligner output: ``features [llm_h·llm_w, text hidden]``, rows row-major over the token grid."""

    llm_h: int
    llm_w: int
    features: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("llm_h", "llm_w"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"ImageFeatures.{name} must be a positive integer, got {value!r}")
        f = self.features
        if not isinstance(f, torch.Tensor) or f.ndim != 2 or f.shape[0] != self.llm_h * self.llm_w:
            shape = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(
                f"ImageFeatures.features must be [llm_h*llm_w={self.llm_h * self.llm_w}, hidden] "
                f"for a {self.llm_h}x{self.llm_w} grid, got {shape}"
            )


# -- preprocessing -----------------------------------------------------------------------------------------------
def plan_image_grid(width: int, height: int, cfg: DeepseekV41VisionConfig) -> ImageGrid:
    """The released resize plan for a ``width``×``height`` image (NeMo ``_plan_image_grid``, same arithmetic)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if cfg.max_image_tokens < 4:
        raise ValueError(f"vision_config.max_image_tokens must be >= 4, got {cfg.max_image_tokens}")
    w: float = width
    h: float = height
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        w = height * cfg.max_wh_ratio
    if w * h < cfg.min_pixels:
        scale = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    p, r, budget = cfg.patch_size, cfg.downsample_ratio, cfg.max_image_tokens
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    llm_h, llm_w = math.ceil(best_h // p / r), math.ceil(best_w // p / r)
    if llm_h * (llm_w + 1) + 2 > budget:
        aspect = h / w
        max_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5  # largest llm_w with llm_w·aspect·(llm_w+1)+2 = budget
        max_h = max_w * aspect
        cell = p * r
        if max_w < 1:  # very tall: one column
            best_h, best_w = (budget - 2) // 2 * cell, cell
        elif max_h < 1:  # very wide: one row
            best_h, best_w = cell, (budget - 3) * cell
        else:
            beta = min(math.floor(max_w) * cell / w, math.floor(max_h) * cell / h)
            best_h, best_w = math.floor(h * beta / p) * p, math.floor(w * beta / p) * p
        llm_h, llm_w = math.ceil(best_h // p / r), math.ceil(best_w // p / r)
    if min(best_h, best_w) <= 0 or llm_h * (llm_w + 1) + 2 > budget:
        raise ValueError(f"a {width}x{height} image cannot fit in max_image_tokens={budget}")
    return ImageGrid(best_w, best_h, best_h // p, best_w // p, llm_h, llm_w)


def load_image(source: Image.Image | bytes | str | Path) -> Image.Image:
    """An RGB PIL image from a PIL image, encoded bytes or a file path (no EXIF transpose, like NeMo)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, bytes | bytearray):
        with Image.open(io.BytesIO(source)) as img:
            return img.convert("RGB")
    if isinstance(source, str | Path):
        with Image.open(source) as img:
            return img.convert("RGB")
    raise TypeError(f"unsupported image source {type(source).__name__}: pass a PIL image, bytes or a path")


def preprocess_image(
    source: Image.Image | bytes | str | Path, cfg: DeepseekV41VisionConfig, dtype: torch.dtype = torch.bfloat16
) -> PreprocessedImage:
    """Resize/pad, normalize to ``[-1, 1]`` and patchify one image (pixels rounded to ``dtype``, bf16 as NeMo)."""
    from PIL import ImageOps

    image = load_image(source)
    grid = plan_image_grid(image.width, image.height, cfg)
    if cfg.max_wh_ratio is not None and image.width >= cfg.max_wh_ratio * image.height:
        image = image.resize((grid.width, grid.height))
    else:
        image = ImageOps.pad(image, (grid.width, grid.height), color=PAD_COLOR)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(dtype)
    p = cfg.patch_size
    patches = (
        pixels.reshape(3, grid.vit_h, p, grid.vit_w, p).permute(1, 3, 0, 2, 4).reshape(grid.vit_h * grid.vit_w, 3, p, p)
    )
    return PreprocessedImage(patches, grid.vit_h, grid.vit_w, grid.llm_h, grid.llm_w)


# -- sequence layout ---------------------------------------------------------------------------------------------
def image_span_types(llm_h: int, llm_w: int) -> list[int]:
    """``vision_token_types`` of one image span: ``[0] + ([1]*llm_w + [2])*llm_h + [3]``."""
    if type(llm_h) is not int or type(llm_w) is not int or llm_h <= 0 or llm_w <= 0:
        raise ValueError(f"image token grid must be two positive integers, got {llm_h!r}x{llm_w!r}")
    return [IMAGE_START] + ([IMAGE] * llm_w + [IMAGE_NEWLINE]) * llm_h + [IMAGE_END]


def _grid_of(item: tuple[int, int] | ImageFeatures | PreprocessedImage) -> tuple[int, int]:
    if isinstance(item, ImageFeatures | PreprocessedImage):
        return item.llm_h, item.llm_w
    if isinstance(item, tuple | list) and len(item) == 2:
        return item[0], item[1]
    raise ValueError(f"an image grid must be (llm_h, llm_w), ImageFeatures or PreprocessedImage, got {item!r}")


def expand_image_placeholders(
    token_ids: Sequence[int] | torch.Tensor,
    grids: Sequence[tuple[int, int] | ImageFeatures | PreprocessedImage],
    image_token_id: int,
) -> tuple[list[int], list[int]]:
    """Expand each ``image_token_id`` (one per image, in order) into its span; returns ``(ids, vision_token_types)``.

    Every span position carries ``image_token_id``; text positions get type -1 (``TEXT``).
    """
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    n_placeholders = ids.count(image_token_id)
    if n_placeholders != len(grids):
        raise ValueError(
            f"{n_placeholders} image placeholder token(s) (id {image_token_id}) but {len(grids)} image(s) given"
        )
    spans = iter([image_span_types(*_grid_of(g)) for g in grids])
    out_ids: list[int] = []
    out_types: list[int] = []
    for tok in ids:
        if tok != image_token_id:
            out_ids.append(tok)
            out_types.append(TEXT)
            continue
        span = next(spans)
        out_ids.extend([image_token_id] * len(span))
        out_types.extend(span)
    return out_ids, out_types


def image_spans(types: Sequence[int] | torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(start, end, llm_h, llm_w)`` of every image span in ``vision_token_types`` (``end`` exclusive).

    Raises ``ValueError`` when a span is malformed (not START, equal-width IMAGE rows each closed by NEWLINE, END).
    """
    t = torch.as_tensor(types)
    if t.ndim != 1:
        raise ValueError(f"vision_token_types must be 1-D [T], got shape {tuple(t.shape)}")
    if bool(((t < TEXT) | (t > IMAGE_END)).any()):
        raise ValueError("vision_token_types values must be in {-1, 0, 1, 2, 3}")
    starts = torch.nonzero(t == IMAGE_START).flatten().tolist()
    ends = torch.nonzero(t == IMAGE_END).flatten().tolist()
    if len(starts) != len(ends):
        raise ValueError(f"vision_token_types has {len(starts)} IMAGE_START but {len(ends)} IMAGE_END")
    spans = []
    prev_end = 0
    for s, e in zip(starts, ends):
        if s < prev_end or e < s:
            raise ValueError(f"image spans are not well nested (START at {s}, END at {e})")
        inner = t[s + 1 : e].tolist()
        llm_h = inner.count(IMAGE_NEWLINE)
        llm_w = (len(inner) - llm_h) // llm_h if llm_h else 0
        if llm_w <= 0 or inner != ([IMAGE] * llm_w + [IMAGE_NEWLINE]) * llm_h:
            raise ValueError(f"image span at {s}..{e} is not [START] + ([IMG]*w + [NEWLINE])*h + [END]")
        spans.append((s, e + 1, llm_h, llm_w))
        prev_end = e + 1
    if sum(e - s for s, e, _, _ in spans) != int((t >= 0).sum()):
        raise ValueError("vision_token_types has image-span types outside complete START..END spans")
    return spans


def splice_image_embeddings(
    embeds: torch.Tensor,
    types: Sequence[int] | torch.Tensor,
    features: Sequence[ImageFeatures | torch.Tensor],
    image_start: torch.Tensor,
    image_newline: torch.Tensor,
    image_end: torch.Tensor,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Write image features and learned delimiters into token embeddings ``embeds [T, D]``.

    ``types`` are the ``vision_token_types`` of the same T positions; ``features[k]`` (``[llm_h·llm_w, D]``) fills
    the type-1 positions of the k-th span in row-major order. Values are cast to ``embeds.dtype``; text rows are
    untouched. Returns a new tensor unless ``inplace``.
    """
    if embeds.ndim != 2:
        raise ValueError(f"embeds must be [T, D], got shape {tuple(embeds.shape)}")
    n_tok, dim = embeds.shape
    t = torch.as_tensor(types, device=embeds.device)
    if t.shape != (n_tok,):
        raise ValueError(f"vision_token_types must have shape [{n_tok}] like embeds, got {tuple(t.shape)}")
    for name, vec in (("image_start", image_start), ("image_newline", image_newline), ("image_end", image_end)):
        if vec.shape != (dim,):
            raise ValueError(f"{name} must have shape [{dim}] (embedding width), got {tuple(vec.shape)}")
    spans = image_spans(t)
    if len(spans) != len(features):
        raise ValueError(f"{len(spans)} image span(s) in vision_token_types but {len(features)} feature set(s)")
    out = embeds if inplace else embeds.clone()
    for k, ((s, e, llm_h, llm_w), item) in enumerate(zip(spans, features)):
        feats = item.features if isinstance(item, ImageFeatures) else item
        if feats.ndim != 2 or feats.shape[1] != dim:
            raise ValueError(f"image {k}: features must be [rows, {dim}] (embedding width), got {tuple(feats.shape)}")
        if isinstance(item, ImageFeatures) and (item.llm_h, item.llm_w) != (llm_h, llm_w):
            raise ValueError(f"image {k}: features are for a {item.llm_h}x{item.llm_w} grid, span is {llm_h}x{llm_w}")
        if feats.shape[0] != llm_h * llm_w:
            raise ValueError(f"image {k}: {feats.shape[0]} feature rows but the span has {llm_h}x{llm_w} image tokens")
        span = out[s:e]
        span[t[s:e] == IMAGE] = feats.to(device=out.device, dtype=out.dtype)
    for kind, vec in ((IMAGE_START, image_start), (IMAGE_NEWLINE, image_newline), (IMAGE_END, image_end)):
        out[t == kind] = vec.to(device=out.device, dtype=out.dtype)
    return out
