"""A speculative step that mixes verify rows with prompt chunks, run as two forwards: the prompt chunks as a plain
step, the verify rows (with the step's other decode rows) on the decode path (``verify_step``), whose sub-steps
cannot hold a chunk longer than a ring. Without the split such a step runs on the ragged path: eager attention with
per-sequence bookkeeping in every layer for every row, several times a verify step's cost on the decode path, in
every step in which a new prompt's chunk joins a batch that drafts.

The two forwards touch different sequences, so each sequence's state is what one step would leave; the outputs are
put back in the step's row order, and the rollback's row offsets (and V4.1's host token ids) are the step's, so the
caller sees one forward. Two forwards read the weights twice: against the ragged path's per-row eager attention
that is the cheaper side (docs/speculative_decoding.md). A step with image features, or in a worker whose experts are
spread over ranks (each rank runs one forward a step), runs on the ragged path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4.verify_step import PooledVerify
from deepinfer.runtime.host_copy import to_device


@dataclass
class MixedStep:
    """A step's two parts: ``verify`` (the verified chunks and the one-token ones; ``verified``: the verified chunks'
    indices in it) and ``rest`` (the other chunks), and where their rows sit in the step (``rows_*``, on the
    device)."""

    batch: ForwardBatch
    verify: ForwardBatch
    rest: ForwardBatch
    verified: list[int]
    of_verify: list[int]  # the step's chunk index of each verify-part chunk
    rows_verify: torch.Tensor
    rows_rest: torch.Tensor

    def merge(self, verify: torch.Tensor | None, rest: torch.Tensor | None) -> torch.Tensor | None:
        """Rows of the two parts (streams, features) in the step's row order (None where either is None)."""
        if verify is None or rest is None:
            return None
        out = verify.new_empty(self.batch.num_tokens, *verify.shape[1:])
        out.index_copy_(0, self.rows_verify, verify)
        return out.index_copy_(0, self.rows_rest, rest.to(verify.dtype))

    def adopt(self, pooled: PooledVerify) -> PooledVerify:
        """The verify part's rollback, its row offsets (and host token ids) the step's."""
        full = self.batch.offsets()
        pooled.offsets = [full[self.of_verify[i]] for i in self.verified]
        if pooled.ids is not None:
            b = self.batch
            pooled.ids = (b.host_token_ids if b.host_token_ids is not None else b.token_ids.cpu()).tolist()
        return pooled


def split(model: torch.nn.Module, batch: ForwardBatch, verified: list[int]) -> MixedStep | None:
    """The step's two parts, or None: nothing verified, no chunk longer than one token besides the verified ones
    (the decode path takes the step whole, or refuses it for other reasons), image features in the step, or a MoE
    whose experts are spread over ranks (every rank runs one forward a step: two would run its exchanges twice)."""
    chunks = batch.chunks
    v_set = set(verified)
    rest = [i for i, c in enumerate(chunks) if i not in v_set and c.length > 1]
    if not verified or not rest or batch.input_embeds is not None or batch.image_mask is not None:
        return None
    if any(getattr(layer.ffn, "ep", None) is not None for layer in model.layers[:1]):
        return None
    r_set = set(rest)
    part_v = [i for i in range(len(chunks)) if i not in r_set]
    offsets = batch.offsets()
    rows_v = np.concatenate([np.arange(*offsets[i]) for i in part_v])
    rows_r = np.concatenate([np.arange(*offsets[i]) for i in rest])
    idx_v, idx_r = (to_device(torch.from_numpy(r), batch.device) for r in (rows_v, rows_r))
    at = {i: k for k, i in enumerate(part_v)}
    return MixedStep(batch, _part(batch, part_v, rows_v, idx_v), _part(batch, rest, rows_r, idx_r),
                     [at[i] for i in verified], part_v, idx_v, idx_r)  # fmt: skip


def _part(batch: ForwardBatch, chunks: list[int], rows: np.ndarray, idx: torch.Tensor) -> ForwardBatch:
    """The sub-step of ``chunks`` (their ``rows`` of the step; ``idx`` on the device): its ids and positions taken
    from the step's (device ids: a placeholder's value may not be on the host yet)."""
    part = [batch.chunks[i] for i in chunks]
    if batch.host_token_ids is not None:  # still on the host: the part's copy goes with its own, once
        at = torch.from_numpy(rows)
        return ForwardBatch(None, None, part, host_token_ids=batch.host_token_ids.index_select(0, at),
                            host_positions=batch.host_positions.index_select(0, at), device=batch.device)  # fmt: skip
    return ForwardBatch(batch.token_ids.index_select(0, idx), batch.positions.index_select(0, idx), part)


__all__ = ["MixedStep", "split"]
