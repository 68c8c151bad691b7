"""What the engine knows of a served model: a :class:`ModelFamily` (one per ``model_type``, found through
``engine.models``) and the objects it makes — the model, its config, its paged cache, a sequence's state, a resume
point and a step's batch. The engine reaches a model only through these; a model package implements them
(``deepinfer.models.deepseek_v4.family``, ``deepinfer.models.deepseek_v41.family``), and a third model plugs in the
same way (``engine.models.register``).

A step: the runner keeps one state per running request (``family.new_state()``), builds the step's batch from its
chunks (``family.batch``), runs ``model(batch, cache) -> hidden [T, D]`` and ``model.logits(rows) -> fp32 [R, V]``.
A resume point (prefix caching): ``family.take_snapshot`` at a position, ``snapshot.restore`` (exact) or
``snapshot.restore_replay`` (a compact one, by a bounded replay); off the device it is bytes
(``family.encode_resume`` / ``decode_resume``, tagged ``family.resume_layout``) with the pages the cache reads and
writes (``cache.read_pages`` / ``write_pages``).
Images (a family that takes them): ``family.prepare_images`` expands a prompt's image placeholders and encodes the
images through an :class:`ImageEncoder` (``family.image_encoder(model)``: the model's own tower, or a stand-in such as
a vision-encoder service); its payload comes back to ``family.batch`` with the chunks that cover an image span
(``engine.multimodal``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # (the scheduler and the balancer read configs without torch)
    import torch

Pages = dict[tuple[str, int], "torch.Tensor"]  # a resume point's full pages by (store kind, layer)


class ModelConfig(Protocol):
    """The config facts the engine reads."""

    model_type: str
    vocab_size: int
    eos_token_id: int
    max_position_embeddings: int

    def min_replay(self) -> int:
        """The shortest bounded replay that rebuilds the model's pending state (compact resume points)."""
        ...


class SequenceState(Protocol):
    """A running sequence's short-term state (the model owns it; the engine only checks its length)."""

    num_tokens: int


class PagedCache(Protocol):
    """The model's paged, prefix-shareable state."""

    page_size: int

    def bytes_per_page(self) -> int: ...

    def read_pages(self, pages: torch.Tensor) -> Pages: ...

    def write_pages(self, pages: torch.Tensor, data: Pages) -> None: ...


class Snapshot(Protocol):
    """A resume point at ``position``: what resumes a sequence there besides its full pages."""

    compact: bool

    @property
    def position(self) -> int: ...

    def restore(self, cache: Any, block_table: torch.Tensor, device: torch.device | str) -> Any: ...

    def restore_replay(self, cache: Any, block_table: torch.Tensor, device: torch.device | str, start: int) -> Any: ...


class StepBatch(Protocol):
    """One forward step's tokens (the chunks concatenated in order)."""

    def offsets(self) -> list[tuple[int, int]]:
        """Each chunk's ``[a, b)`` rows of the step."""
        ...

    def substitute(self, at: list[int], sources: list[tuple[torch.Tensor, int]]) -> None:
        """Set token ``at[i]`` to row ``sources[i][1]`` of the device tensor ``sources[i][0]`` (a step in flight)."""
        ...


class ImageEncoder(Protocol):
    """One image's encoded bytes (PNG, JPEG, ...) -> the features a family splices into its prompt (DeepSeek-V4.1:
    ``ImageFeatures``). ValueError for bytes that are no image."""

    def encode(self, image: bytes) -> Any: ...


@runtime_checkable
class ServedModel(Protocol):
    """The model: an ``nn.Module`` with its config, a forward over a batch and the logits of rows."""

    config: Any

    def __call__(self, batch: Any, cache: Any) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def modules(self) -> Any: ...


class ModelFamily(Protocol):
    """One architecture, by config.json's ``model_type``: parses its config, builds and loads its model, and makes
    the engine-side objects of its state."""

    model_type: str
    resume_layout: str  # the tag of ``encode_resume``'s byte format (a kvstore holds blobs of one layout)
    decode_buckets: Sequence[int]  # batch sizes of its decode graphs, warmed before serving; empty: no graphs

    def parse_config(self, raw: dict) -> Any:
        """The model's config from a parsed config.json (ValueError when it does not validate)."""
        ...

    def build(
        self,
        path: Path,
        config: Any,
        ops: Any,
        dtype: torch.dtype,
        device: torch.device,
        quant_sim: bool | None,
        ep: Any = None,
    ) -> Any:
        """The model of ``config`` with the checkpoint at ``path`` loaded in ``dtype`` on ``device``, its weights
        prepared for ``ops``. ``quant_sim`` None: the model's default. ``ep``: this rank's expert-parallel group
        (``parallel.expert_parallel.ExpertParallel``): the MoE layers hold, and load, its experts only."""
        ...

    def new_cache(
        self, config: Any, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> Any:
        """A paged cache of ``num_pages`` pages (ValueError for a ``page_size`` the model cannot page)."""
        ...

    def new_state(self) -> Any:
        """The state of a sequence with no tokens yet."""
        ...

    def take_snapshot(self, state: Any, cache: Any, block_table: torch.Tensor, compact: bool) -> Any:
        """A resume point of ``state`` (its partial page read from ``block_table``'s pages), in host memory; taken
        without waiting for the device (its copies may still be queued: ``encode_resume`` waits for them, a restore
        copies back behind them on the same stream). ``compact``: no short-term state, resumed by a bounded replay."""
        ...

    def encode_resume(self, snapshot: Any, pages: Pages) -> bytes: ...

    def decode_resume(self, data: bytes) -> tuple[Any, Pages]: ...

    def batch(
        self,
        chunks: Sequence[tuple[Any, int, int, torch.Tensor, int | None]],
        token_ids: list[list[int]],
        device: torch.device | str,
        mm: Sequence[Any] | None = None,
    ) -> Any:
        """A step's batch from its chunks, each (state, start, length, block table, decoder_from), and their
        token ids. ``decoder_from`` (a bounded decoder replay): the first position whose decoder layers run, or
        None for every position; a model without such a split ignores it. ``mm`` (only when a chunk covers an image
        span): per chunk its request's ``multimodal.MultiModalInput`` or None."""
        ...

    def image_encoder(self, model: Any) -> ImageEncoder:
        """The model's built-in image encoder (ValueError: the model takes no images)."""
        ...

    def prepare_images(
        self, config: Any, encoder: ImageEncoder, token_ids: list[int], images: Sequence[bytes]
    ) -> tuple[list[int], list[tuple[int, int]], Any]:
        """A prompt's image placeholders (one per image, in order) expanded, the images encoded: ``(token ids,
        [start, end) span of each image, payload for batch)``. ValueError naming the field for a placeholder count
        that differs from the images, an image that does not decode or fit, or a model without image input."""
        ...

    def speculator(self, model: Any, max_drafts: int, proposer: Any = None) -> Any:
        """Speculative decoding for ``model`` (``engine.speculative.steps.Speculator``), drafting up to
        ``max_drafts`` tokens per sequence and step with the model's own drafter, or ``proposer``'s drafts
        (``engine.speculative.oracle``). ValueError: the model (or its checkpoint) cannot speculate."""
        ...

    def fingerprint_facts(self, model: Any) -> list[str]:
        """The model's numerics switches that change the KV state it computes (joined into the worker's
        fingerprint: workers whose facts differ never share resume points)."""
        ...


__all__ = [
    "ImageEncoder",
    "ModelConfig",
    "ModelFamily",
    "PagedCache",
    "Pages",
    "SequenceState",
    "ServedModel",
    "Snapshot",
    "StepBatch",
]
