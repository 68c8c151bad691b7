"""A speculative step that mixes verify rows with prompt chunks, run as two forwards: the prompt chunks as a plain
step, the verify rows (with the step's other decode rows) on the decode path (``verify_step``), whose sub-steps
cannot hold a chunk longer than a ring. Without the split such a step runs on the ragged path: eager attention with
per-sequence bookkeeping in every layer for every row, several times a verify step's cost on the decode path, in
every step in which a new prompt's chunk joins a batch that drafts.

The two forwards touch different sequences, so each sequence's state is what one step would leave; the outputs are
put back in the step's row order, and the rollback's row offsets (and V4.1's host token ids) are the step's, so the
caller sees one forward. Two forwards read the weights twice: against the ragged path's per-row eager attention
that is the cheaper side (docs/speculative_decoding.md). An image prompt's chunk keeps its slice of the image spans
(``images``, rebased to the part's rows: the model splices them in when it runs the part); a step whose embeddings
were given whole runs on the ragged path. In a worker of several ranks every rank runs as many forwards a step as
rank 0 decided (``forwards``: two where any rank's step may split; a rank that runs fewer adds idle ones), and a
step splits only where that is two (the model's ``replay_gate``): each MoE exchange then meets its peers on every
rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.models.deepseek_v4 import verify_rings
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
    (the decode path takes the step whole, or refuses it for other reasons), embeddings given for the whole step,
    image spans in a chunk of the verify part, or a step of a rank group whose ranks run one forward in it (the
    model's ``replay_gate``: two would run each MoE exchange once more than the other ranks)."""
    chunks = batch.chunks
    v_set = set(verified)
    rest = [i for i, c in enumerate(chunks) if i not in v_set and c.length > 1]
    if not verified or not rest or batch.input_embeds is not None or batch.image_mask is not None:
        return None
    offsets = batch.offsets()
    firsts = {offsets[i][0]: i for i in rest}
    images = getattr(batch, "images", ())
    if any(a not in firsts for a, *_ in images):  # (a one-token chunk of an image span: not split)
        return None
    gate = getattr(model, "replay_gate", None)
    if gate is not None and gate.forwards < 2:
        return None
    r_set = set(rest)
    part_v = [i for i in range(len(chunks)) if i not in r_set]
    rows_v = np.concatenate([np.arange(*offsets[i]) for i in part_v])
    rows_r = np.concatenate([np.arange(*offsets[i]) for i in rest])
    idx_v, idx_r = (to_device(torch.from_numpy(r), batch.device) for r in (rows_v, rows_r))
    at = {i: k for k, i in enumerate(part_v)}
    first = dict(zip(rest, np.cumsum([0] + [chunks[i].length for i in rest]).tolist()))
    part_r = _part(batch, rest, rows_r, idx_r, tuple((first[firsts[a]], *tail) for a, *tail in images))
    return MixedStep(batch, _part(batch, part_v, rows_v, idx_v), part_r, [at[i] for i in verified], part_v, idx_v,
                     idx_r)  # fmt: skip


def forwards(model: torch.nn.Module, chunks: list[tuple[int, int]]) -> int:
    """The forwards a step of ``chunks`` (each its tokens and the most drafts it may verify) may run: 2 where
    ``split`` may take it (drafts beside a chunk longer than the model's rings, on a model whose verify steps take
    the decode path), else 1. What a rank group's rank 0 decides for every rank (``parallel.rank_group``); a rank
    whose step runs fewer (its drafter proposed none, a sequence's state keeps it off the decode path) adds idle
    ones."""
    if not getattr(model, "verify_on_decode_path", False) or model.ops.batch_invariant or not model.pooled_decode:
        return 1
    longest = max((n for n, d in chunks if d == 0), default=0)
    return 2 if any(d > 0 for _, d in chunks) and longest > verify_rings.ring_rows(model) else 1


def _part(batch: ForwardBatch, chunks: list[int], rows: np.ndarray, idx: torch.Tensor, images: tuple = ()
          ) -> ForwardBatch:  # fmt: skip
    """The sub-step of ``chunks`` (their ``rows`` of the step; ``idx`` on the device): its ids and positions taken
    from the step's (device ids: a placeholder's value may not be on the host yet); with ``images`` (their first
    rows the part's), a batch of the step's class (the family's image batch) that holds them."""
    part = [batch.chunks[i] for i in chunks]
    cls = type(batch) if images else ForwardBatch
    if batch.host_token_ids is not None:  # still on the host: the part's copy goes with its own, once
        at = torch.from_numpy(rows)
        out = cls(None, None, part, host_token_ids=batch.host_token_ids.index_select(0, at),
                  host_positions=batch.host_positions.index_select(0, at), device=batch.device)  # fmt: skip
    else:
        out = cls(batch.token_ids.index_select(0, idx), batch.positions.index_select(0, idx), part)
    if images:
        out.images = images
    return out


__all__ = ["MixedStep", "forwards", "split"]
