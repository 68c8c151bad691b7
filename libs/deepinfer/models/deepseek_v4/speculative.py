"""DeepSeek-V4's speculative verify step and its exact state rollback (docs/speculative_decoding.md, "State
rollback").

``verify`` runs the target over, per sequence ``b`` at position ``p_b`` (``p_b`` tokens consumed), its last token
and its ``n_b`` drafts: one ragged forward of ``n_b + 1`` rows per sequence (a chunked-prefill step), whose logits
are flat, sequence after sequence (``engine.speculative.acceptance``'s layout). Before it runs it saves what the
rejected rows may destroy; ``VerifyStep.rollback`` then brings each sequence to ``c_b = p_b + a_b + 1`` consumed
tokens (``a_b`` drafts kept), exactly the state of a run without speculation over the same tokens, with no second
forward pass:

* **window rings** (every trunk layer, slot ``pos % W``): the rows of positions ``p + 1 .. p + n`` (the slots the
  drafts write, holding positions ``W`` earlier that later tokens still read) are saved before the step (``n`` rows
  per layer) and the rejected ones put back. Needs ``n_b + 1 <= W``.
* **compressor buffers** (the pending projections): the buffer before the step is saved (at most ``2m`` rows) and
  the attention layers leave the step's projections in ``Attention.capture``; the kept buffer is the one a plain
  run has at ``c``: positions ``max((c // m - overlap) m, start) .. c``, from the saved rows (below ``p``) and the
  captured rows of the kept positions. A pooled buffer (``state_pool.RingBuffer``) takes them in place.
* **compressed rows and indexer keys** (paged): a group completed by kept rows was pooled from kept projections
  only, as a plain run pools it. A group completed by a rejected row wrote row ``w >= c // m``: no reader reads a
  row past the sequence's count, and the row is written again when the group completes with the kept tokens.
* **counters**: ``num_tokens = c``; ``mtp_tokens`` is the drafter's (``mtp_drafter.py``), untouched here.
* **Engram history** (DeepSeek-V4.1: the last ``max_ngram_size - 1`` tokens consumed): the kept positions' tokens
  after the history saved before the step.

Pages a verify step touches for rejected positions stay with the sequence (they are its next positions). The
step may replay the model's piecewise prefill graphs (``runtime.step_graphs``: the attention, which keeps the
projections, runs eagerly between the pieces; the projections are copied by the rollback before the next replay),
never its decode graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import CompressorBuffer, SequenceState, ring_span
from deepinfer.models.deepseek_v4.verify_step import (
    PooledVerify,
    check_rollback,
    kept_history,
)


@dataclass
class SeqSave:
    """What one sequence's verify rows may destroy: the window rows of positions ``start + 1 .. start + drafts``
    per layer (None: the layer had no ring yet) and the compressor buffers (None: none yet), as they were."""

    state: SequenceState
    start: int  # p: tokens consumed before the step
    drafts: int  # n
    history: tuple[int, ...] = ()  # the Engram history before the step (V4.1)
    windows: dict[int, torch.Tensor | None] = field(default_factory=dict)
    buffers: dict[tuple[int, str], CompressorBuffer | None] = field(default_factory=dict)


def save_windows(st: SequenceState, layers: list[int], first: int, count: int) -> dict[int, torch.Tensor | None]:
    """Copies of the ring rows of positions ``first .. first + count`` of ``layers`` (None where a layer has none)."""
    out: dict[int, torch.Tensor | None] = {}
    for layer in layers:
        ring = st.windows.get(layer)
        if ring is None:
            out[layer] = None
            continue
        if count > ring.shape[0]:
            raise ValueError(f"{count} speculative rows overrun layer {layer}'s window of {ring.shape[0]}")
        parts = ring_span(ring, first, count)
        out[layer] = torch.cat(parts).clone() if parts else ring[:0].clone()
    return out


def restore_windows(
    st: SequenceState, saved: dict[int, torch.Tensor | None], first: int, count: int, skip: int
) -> None:
    """Put back the saved rows of positions ``first + skip .. first + count`` (``save_windows(.., first, count)``):
    the slots of the rejected rows hold again what they held before the step (zeros where there was no ring)."""
    for layer, rows in saved.items():
        ring = st.windows.get(layer)
        if ring is None:
            continue
        done = skip
        for part in ring_span(ring, first + skip, count - skip):
            if rows is None:
                part.zero_()
            else:
                part.copy_(rows[done : done + part.shape[0]])
            done += part.shape[0]


def _compressors(model: torch.nn.Module) -> dict[tuple[int, str], tuple[int, bool, torch.nn.Module]]:
    """``{(layer, name): (ratio, overlap, attention)}`` of every trunk compressor that keeps pending rows
    (``attn.pending``; the attention layer stores them its way: ``attn.keep_pending``)."""
    out = {}
    for layer in model.layers:
        for name, comp in layer.attn.pending():
            out[(layer.attn.layer_id, name)] = (comp.ratio, comp.overlap, layer.attn)
    return out


def kept_buffer(
    old: CompressorBuffer | None, new: tuple[torch.Tensor, torch.Tensor], p: int, c: int, m: int, overlap: bool
) -> CompressorBuffer:
    """The buffer a plain run holds at ``c`` consumed tokens: ``old`` the buffer at ``p`` (positions ``old.start ..
    p``), ``new`` the projections (kv, score) of positions ``p .. c``."""
    base = p if old is None else old.start
    start = max(max(c // m - (1 if overlap else 0), 0) * m, base)
    if start < p:
        kv = torch.cat([old.kv[start - base :], new[0]])
        score = torch.cat([old.score[start - base :], new[1]])
    else:
        kv, score = new[0][start - p :].clone(), new[1][start - p :].clone()
    return CompressorBuffer(kv=kv, score=score, start=start)


@dataclass
class VerifyStep:
    """One verify forward: ``logits [R, vocab]`` (fp32, flat rows), the trunk's ``hidden [R, hc, D]`` (what the MTP
    drafter reads), ``offsets`` (each sequence's rows), and what ``rollback`` needs."""

    model: torch.nn.Module
    batch: ForwardBatch
    hidden: torch.Tensor
    logits: torch.Tensor
    offsets: list[tuple[int, int]]
    saves: list[SeqSave]
    captured: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    done: bool = False

    def rollback(self, accepted: list[int]) -> None:
        """Bring every sequence to ``p_b + accepted[b] + 1`` consumed tokens (module docstring)."""
        check_rollback(self.done, self.saves, accepted)
        comps = _compressors(self.model)
        ids = None
        if any(save.state.history for save in self.saves):  # the verified tokens, on the host (V4.1's Engram)
            b = self.batch
            ids = (b.host_token_ids if b.host_token_ids is not None else b.token_ids.cpu()).tolist()
        for save, a, (lo, _) in zip(self.saves, accepted, self.offsets):
            st, p = save.state, save.start
            c = p + a + 1
            restore_windows(st, save.windows, p + 1, save.drafts, a)
            for key, old in save.buffers.items():
                m, overlap, attn = comps[key]
                kv, score = self.captured[key]
                attn.keep_pending(st, key, kept_buffer(old, (kv[lo : lo + a + 1], score[lo : lo + a + 1]), p, c, m,
                                                       overlap))  # fmt: skip
            if st.history:  # the last tokens consumed (blocked = -1 before the first): the kept positions'
                st.history = kept_history(save.history, ids[lo : lo + a + 1], len(st.history))
            st.num_tokens = c
        self.done, self.captured = True, {}  # the projections are not needed any more


def save_states(model: torch.nn.Module, states: list[SequenceState], drafts: list[int]) -> list[SeqSave]:
    """``SeqSave`` of each of ``states`` before a verify step with ``drafts[b]`` drafts."""
    layers, comps = [layer.attn.layer_id for layer in model.layers], list(_compressors(model))
    saves = []
    for st, n in zip(states, drafts):
        p = st.num_tokens
        save = SeqSave(st, p, n, st.history)
        save.windows = save_windows(st, layers, p + 1, n)
        for key in comps:
            b = st.buffers.get(key)
            save.buffers[key] = None if b is None else CompressorBuffer(b.kv.clone(), b.score.clone(), b.start)
        saves.append(save)
    return saves


def capturing_forward(
    model: torch.nn.Module, batch: ForwardBatch, cache: PagedKVCache | None, **kw: object
) -> tuple[torch.Tensor, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
    """The model's forward on ``batch`` (``kw``: the model's own options) as a verify step runs it: the attention
    layers keep copies of their compressor projections (``Attention.capture``; no decode graphs). Returns the hidden
    streams and the projections by ``(layer, compressor)``."""
    attns = [layer.attn for layer in model.layers]
    for a in attns:
        a.capture = {}
    model.verifying = True
    try:
        h = model(batch, cache, **kw)
        return h, {(a.layer_id, name): v for a in attns for name, v in a.capture.items()}
    finally:
        model.verifying = False
        for a in attns:
            a.capture = None


@torch.no_grad()
def verify(
    model: torch.nn.Module,
    cache: PagedKVCache | None,
    states: list[SequenceState],
    block_tables: list[torch.Tensor],
    last_tokens: list[int],
    drafts: list[list[int]],
) -> VerifyStep | PooledVerify:
    """The verify forward of sequences ``states`` (module docstring); roll back with ``VerifyStep.rollback``. On
    the decode path (``verify_step``) where it takes the step."""
    window = getattr(model, "text", model.config).sliding_window  # (V4.1: its text config)
    for d in drafts:
        if len(d) + 1 > window:
            raise ValueError(f"{len(d)} drafts need {len(d) + 1} window rows; the window holds {window}")
    chunks = [SeqChunk(st, st.num_tokens, len(d) + 1, t) for st, d, t in zip(states, drafts, block_tables)]
    batch = ForwardBatch.build(chunks, [[x, *d] for x, d in zip(last_tokens, drafts)], device=model.embed.weight.device)
    got = model.verify_forward(batch, cache, list(range(len(chunks))))
    if got is not None:  # on the decode path (the model's ``verify_step``)
        h, _, step = got
        step.hidden, step.logits = h, model.logits(h)
        return step
    saves = save_states(model, states, [len(d) for d in drafts])
    h, captured = capturing_forward(model, batch, cache)
    return VerifyStep(model, batch, h, model.logits(h), batch.offsets(), saves, captured)


__all__ = [
    "SeqSave", "VerifyStep", "capturing_forward", "kept_buffer", "restore_windows", "save_states", "save_windows",
    "verify",
]  # fmt: skip
