"""The nvidia op sets' kernel attention (``deepinfer.ops.nvidia``) against the reference ops, and batch
invariance of a model running them. On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops.invariant import BatchInvariantOps  # noqa: E402
from deepinfer.ops.nvidia import _KernelAttention, visible_keys  # noqa: E402
from deepinfer.ops.reference import ReferenceOps  # noqa: E402


class KernelInvariantOps(_KernelAttention, BatchInvariantOps):
    """NvidiaInvariantOps' attention on whatever device the kernels run (the interpreter on CPU)."""

    def __init__(self) -> None:
        BatchInvariantOps.__init__(self, "cpu")
        self._load_kernels()


def test_visible_keys_are_in_list_order_first():
    mask = torch.tensor([[False, True, False, True], [False, False, False, False], [True, True, True, False]])
    idx, count = visible_keys(mask)
    assert count.tolist() == [2, 0, 3]
    assert idx[0, :2].tolist() == [1, 3] and idx[2, :3].tolist() == [0, 1, 2]


def test_kernel_attention_and_indexer_match_the_reference():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(5, 3, 48, generator=g), torch.randn(40, 48, generator=g)
    mask, sink, w = torch.rand(5, 40, generator=g) < 0.5, torch.randn(3, generator=g), torch.rand(5, 3, generator=g)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        q, keys, mask, sink, w = (t.cuda() for t in (q, keys, mask, sink, w))
    mask[2] = False  # a query that sees nothing but the sink
    k, r = KernelInvariantOps(), ReferenceOps()
    got, ref = k.sparse_attention(q, keys, mask, sink, 0.1), r.sparse_attention(q, keys, mask, sink, 0.1)
    assert (got - ref).abs().max().item() < 1e-5 and not got[2].any()
    assert (k.indexer_scores(q, keys, w) - r.indexer_scores(q, keys, w)).abs().max().item() < 1e-5


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors through the interpreter; on a GPU bench/batch_invariance.py checks"
)
def test_a_model_on_the_kernel_ops_is_batch_invariant(tiny_dirs):
    from deepinfer.checkpoint.loader import load_checkpoint
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from models.test_batch_invariance import run, tokens

    path = tiny_dirs["odd"]
    model = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"), KernelInvariantOps())
    load_checkpoint(model, path, dtype=torch.float32, progress=False)
    vocab = model.config.vocab_size
    target, a, b = tokens(40, 1, vocab), tokens(13, 2, vocab), tokens(9, 3, vocab)
    alone = run(model, [target], [[36, 1, 1, 1, 1]], None)[0]
    mixed = run(model, [target, a, b], [[0, 5, 31, 1, 1, 1, 1], [4, 9], [1] * 9], None)[0]
    assert torch.equal(alone, mixed)
    model.ops = ReferenceOps()
    assert (run(model, [target], [[40]], None)[0] - alone).abs().max().item() < 1e-4
