"""DeepSeek-V4.1 image prompts as the engine serves them (``engine.model_api``'s image hooks, docs/deepseek_v41.md
("Images")).

* :class:`BuiltinImageEncoder` — the model's own tower: image bytes -> ``preprocess_image`` -> ``encode_image`` ->
  :class:`ImageFeatures` (any encoder of the same contract may stand in, e.g. a vision-encoder service);
* :func:`prepare_image_prompt` — a prompt's placeholders expanded with the encoded images' grids, and the payload
  (:class:`ImagePrompt`: each position's ``vision_token_types`` and feature row, the features);
* :class:`ImageBatch` / :func:`chunk_embeddings` — a step whose chunks cover image spans, and its input embeddings:
  each chunk takes the slice of its prompt's spans it covers, so chunked prefill may cut a span anywhere and gives
  the embeddings ``splice_image_embeddings`` gives the whole prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.image import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEWLINE,
    IMAGE_START,
    ImageFeatures,
    expand_image_placeholders,
    preprocess_image,
)


class BuiltinImageEncoder:
    """The checkpoint's vision tower and aligner on encoded image bytes."""

    def __init__(self, model: Any) -> None:
        if getattr(model, "vision", None) is None:
            raise ValueError("images: this checkpoint has no vision tower (vision_config.num_hidden_layers is 0)")
        self.model = model

    def encode(self, image: bytes) -> ImageFeatures:
        from PIL import UnidentifiedImageError

        try:
            pre = preprocess_image(image, self.model.config.vision_config)  # pixels in bf16, as the processor
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"images: the bytes are not an image this server can decode ({e})") from e
        return self.model.encode_image(pre)


@dataclass(frozen=True)
class ImagePrompt:
    """The payload of a prompt with images: per prompt position its ``vision_token_types`` (``types [P]``) and the
    row of ``features`` an image position takes (``rows [P]``, -1 elsewhere); ``features`` are every image's,
    concatenated in order."""

    types: torch.Tensor
    rows: torch.Tensor
    features: torch.Tensor


def prepare_image_prompt(
    config: DeepseekV41Config, encoder: Any, token_ids: list[int], images: Sequence[bytes]
) -> tuple[list[int], list[tuple[int, int]], ImagePrompt]:
    """Encode ``images``, expand the placeholders of ``token_ids`` (one per image, in order): ``(ids, spans,
    payload)``."""
    if config.vision_config.num_hidden_layers == 0:
        raise ValueError("images: this checkpoint has no vision tower (vision_config.num_hidden_layers is 0)")
    count = token_ids.count(config.image_token_id)
    if count != len(images):
        raise ValueError(
            f"prompt: {count} image placeholder token(s) (id {config.image_token_id}) but {len(images)} image(s)"
        )
    hidden = config.text_config.hidden_size
    feats = []
    for k, image in enumerate(images):
        f = encoder.encode(image)
        if not isinstance(f, ImageFeatures) or f.features.shape[1] != hidden:
            got = tuple(f.features.shape) if isinstance(f, ImageFeatures) else type(f).__name__
            raise ValueError(f"images[{k}]: the encoder must give ImageFeatures of width {hidden}, got {got}")
        feats.append(f)
    ids, types = expand_image_placeholders(token_ids, feats, config.image_token_id)
    t = torch.tensor(types, dtype=torch.long)
    rows = torch.full_like(t, -1)
    image = t == IMAGE
    rows[image] = torch.arange(int(image.sum()))  # row-major within a span, spans in order: the features' order
    starts = torch.nonzero(t == IMAGE_START).flatten().tolist()
    ends = torch.nonzero(t == IMAGE_END).flatten().tolist()
    spans = [(s, e + 1) for s, e in zip(starts, ends)]
    return ids, spans, ImagePrompt(t, rows, torch.cat([f.features for f in feats]))


class ImageBatch(ForwardBatch):
    """A step whose chunks cover image spans: ``images`` lists, per such chunk, (its first row in the batch, its
    first position, its length, its prompt's :class:`ImagePrompt`)."""

    images: tuple[tuple[int, int, int, ImagePrompt], ...] = ()


@torch.no_grad()
def chunk_embeddings(model: Any, batch: ImageBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input embeddings [T, hidden], image mask [T])`` of an :class:`ImageBatch`: the token embeddings, with
    each chunk's slice of its image spans spliced in (features row-major into image positions, the learned
    ``image_start`` / ``image_newline`` / ``image_end`` into the delimiters), exactly as for the whole prompt."""
    x = model.embed(batch.token_ids)
    mask = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    vectors = {IMAGE_START: model.image_start, IMAGE_NEWLINE: model.image_newline, IMAGE_END: model.image_end}
    for a, start, length, prompt in batch.images:
        end = min(start + length, prompt.types.shape[0])  # a recomputed chunk may run past the prompt
        if end <= start:
            continue
        t = prompt.types[start:end].to(x.device)
        r = prompt.rows[start:end].to(x.device)
        seg = x[a : a + end - start]
        if bool(((t >= 0) & (batch.token_ids[a : a + end - start] != model.config.image_token_id)).any()):
            raise ValueError(f"image-span positions must carry image_token_id {model.config.image_token_id}")
        sel = r >= 0
        seg[sel] = prompt.features[r[sel].to(prompt.features.device)].to(device=x.device, dtype=x.dtype)
        for kind, vec in vectors.items():
            seg[t == kind] = vec.to(device=x.device, dtype=x.dtype)
        mask[a : a + end - start] = t >= 0
    return x, mask


__all__ = ["BuiltinImageEncoder", "ImageBatch", "ImagePrompt", "chunk_embeddings", "prepare_image_prompt"]
