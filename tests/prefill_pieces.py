"""Helpers of the piecewise prefill graph tests (``tests/kernels/test_prefill_graphs*.py``): a plan of steps run from
empty states, two runs compared, a graph class whose "graphs" run their pieces eagerly on any device, and pieces
whose capture fails."""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState


def run_plan(model, plan, graphs: bool, *, vocab: int, low: int, page: int, dev: str, seed: int = 0, decodes: int = 0):
    """Run ``plan`` (steps, each a list of ``(sequence, tokens)``, token ids in ``[low, vocab)``) from empty states
    with ``model.ops.prefill_graphs = graphs``, then ``decodes`` decode steps of every sequence without them (on CUDA
    the decode graphs take those): the output of every step, the cache and the states."""
    gen = torch.Generator().manual_seed(seed)
    n_seq = 1 + max(s for step in plan for s, _ in step)
    pages = -(-(sum(n for step in plan for _, n in step) + 8) // page)
    cache = PagedKVCache(model.config, pages * n_seq, page, dtype=model.embed.weight.dtype, device=dev)
    states = [SequenceState() for _ in range(n_seq)]
    tables = [torch.arange(i * pages, (i + 1) * pages, device=dev) for i in range(n_seq)]
    outs = []
    for i, step in enumerate(plan + [[(s, 1) for s in range(n_seq)]] * decodes):
        model.ops.prefill_graphs = graphs and i < len(plan)
        chunks = [SeqChunk(states[s], states[s].num_tokens, n, tables[s]) for s, n in step]
        ids = [torch.randint(low, vocab, (n,), generator=gen).tolist() for _, n in step]
        outs.append(model(ForwardBatch.build(chunks, ids, dev), cache))
    model.ops.prefill_graphs = True
    return outs, cache, states


def same_runs(a, b, exact: bool, atol: float = 2e-4, rtol: float = 0.0) -> None:
    """Two ``run_plan`` results agree: outputs, caches (every page) and sequence states (bit for bit with
    ``exact``)."""
    same = torch.equal if exact else (lambda x, y: torch.allclose(x, y, atol=atol, rtol=rtol))
    (oa, ca, sa), (ob, cb, sb) = a, b
    for i, (x, y) in enumerate(zip(oa, ob)):
        assert x.shape == y.shape and same(x, y), (i, (x - y).abs().max().item())
    for kind, layer in ca.stores():
        assert same(ca._store(kind, layer).float(), cb._store(kind, layer).float()), (kind, layer)
    for x, y in zip(sa, sb):
        assert x.num_tokens == y.num_tokens and x.history == y.history and x.windows.keys() == y.windows.keys()
        assert all(same(x.windows[k], y.windows[k]) for k in x.windows)
        for k, buf in x.buffers.items():
            other = y.buffers[k]
            assert buf.start == other.start and same(buf.kv, other.kv) and same(buf.score, other.score)


class _Piece:
    """Stands in for a captured graph: ``replay`` runs the piece eagerly."""

    def __init__(self, piece) -> None:
        self.replay = piece


def eager_pieces(graphs_class: type) -> type:
    """A subclass of ``graphs_class`` (a ``PiecewiseGraphs``) with its step plumbing and no CUDA: each "graph" runs
    its piece eagerly, on any device."""

    class EagerPieces(graphs_class):
        def applies(self, batch: ForwardBatch) -> bool:
            return self.graphable(batch)

        def _capture(self, size: int, device: torch.device, extra: tuple = (), before=None):
            bk = self._bucket(size, device, *extra)
            bk.graphs = [_Piece(p) for p in self._segments(bk)]
            return bk

    return EagerPieces


def failing_capture(graphs_class: type):
    """A ``_segments`` for ``graphs_class`` whose first piece syncs the host while being captured (not allowed: the
    bucket's capture fails and its steps run eagerly); set it with ``monkeypatch.setattr``."""
    pieces = graphs_class._segments

    def failing(self, bk):
        first, *rest = pieces(self, bk)

        def first_then_sync():
            first()
            if torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()  # not allowed while capturing

        return [first_then_sync, *rest]

    return failing
