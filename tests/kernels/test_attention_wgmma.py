"""The Gluon kernel of the sparse attention's wide tiles (deepinfer.kernels.attention_wgmma) against the Triton wide
tiles of ``kernels.attention`` and the reference, and the rule that picks it.

Gluon kernels do not run in Triton's interpreter, so the kernel's tests need an sm_90 GPU (CI on a CPU host skips
them); the dispatch rule and the fallback after a failed build are checked everywhere.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from test_attention import _idx, _randn, _ref_attention, _rel  # noqa: E402

from deepinfer import envs  # noqa: E402
from deepinfer.kernels import attention as attn  # noqa: E402
from deepinfer.kernels import attention_wgmma as wg  # noqa: E402
from deepinfer.kernels.attention import sparse_attention_gather  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = torch.cuda.is_available() and not INTERPRET and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not (HOPPER and wg.HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")


def test_the_setting_and_the_inputs_pick_it(monkeypatch):
    """``DEEPINFER_ATTN_PREFILL``: gluon (default) or triton, handed over by the nvidia backend as ``ENABLED`` (the
    kernels read no settings); the kernel only for bf16 ``[n, 64·k, 512]`` on sm_90."""
    from deepinfer.backends.nvidia.settings import hand_over
    from deepinfer.kernels import moe_mxfp4_wgmma, pdl

    for module, knob in ((wg, "ENABLED"), (moe_mxfp4_wgmma, "PREFILL"), (pdl, "ENABLED")):
        monkeypatch.setattr(module, knob, getattr(module, knob))  # as they were, after the test
    monkeypatch.setattr(wg, "FAILED", False)
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    assert not wg.use(q)  # a CPU tensor
    for value, want in (("Triton", False), (None, True), ("triton", False), ("gluon", True)):
        if value is None:
            monkeypatch.delenv("DEEPINFER_ATTN_PREFILL", raising=False)
        else:
            monkeypatch.setenv("DEEPINFER_ATTN_PREFILL", value)
        hand_over()
        assert wg.ENABLED is want, value
    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL", "cuda-cores")
    with pytest.raises(envs.EnvError, match="DEEPINFER_ATTN_PREFILL"):
        hand_over()


def test_a_failed_build_falls_back_once(monkeypatch):
    """A Triton whose Gluon API differs: the first wide call that fails logs and returns the Triton wide tiles'
    result, later calls go straight to them (the interpreter on a CPU host, the real kernels on a GPU)."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    n, H, d, K, W = 3, 4, 32, 40, 30
    q, keys = _randn(n, H, d, seed=60).to(dev), _randn(K, d, seed=61).to(dev)
    idx, count = _idx(n, W, K, [0, 7, 30], seed=62)
    sink = _randn(H, seed=63).to(dev)
    want = sparse_attention_gather(q, keys, idx, count, sink, 0.2, split=False, wide=True)
    tries = []

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tries.append(1)
                raise RuntimeError("an unknown Gluon builtin")

            return launch

    monkeypatch.setattr(wg, "FAILED", False)
    monkeypatch.setattr(wg, "HAVE_GLUON", True)
    monkeypatch.setattr(wg, "_wg_attention_kernel", Broken(), raising=False)
    monkeypatch.setattr(wg, "use", lambda q: not wg.FAILED)
    assert torch.equal(sparse_attention_gather(q, keys, idx, count, sink, 0.2, split=False, wide=True), want)
    assert tries == [1] and wg.FAILED
    assert torch.equal(sparse_attention_gather(q, keys, idx, count, sink, 0.2, split=False, wide=True), want)
    assert tries == [1]
    # the narrow tiles never ask
    monkeypatch.setattr(wg, "use", lambda q: pytest.fail("asked for narrow tiles"))
    sparse_attention_gather(q, keys, idx, count, sink, 0.2, split=False)


def _problem(n, W, K, counts, seed):
    H, d = 64, 512
    q = _randn(n, H, d, seed=seed, dtype=torch.bfloat16)
    keys = _randn(K, d, seed=seed + 1, dtype=torch.bfloat16)
    idx, count = _idx(n, W, K, counts, seed=seed + 2)
    return q, keys, idx, count, _randn(H, seed=seed + 3), d**-0.5


@hopper_only
def test_gpu_matches_the_triton_wide_tiles_and_the_reference(monkeypatch):
    """V4-Flash widths, counts at and around the key blocks, an empty list; close to the Triton wide tiles (the same
    blocks and roundings of ``p``, other fp32 sum orders) and to the reference; one query alone gives its bits."""
    n, W, K = 300, 640, 5000
    counts = [0, 1, 63, 64, 65, 127, 128, 129, 500, 640] + [
        int(c) for c in torch.randint(1, W + 1, (n - 10,), generator=torch.Generator().manual_seed(5))
    ]
    q, keys, idx, count, sink, scale = _problem(n, W, K, counts, seed=100)
    monkeypatch.setattr(wg, "ENABLED", True)  # DEEPINFER_ATTN_PREFILL=gluon
    monkeypatch.setattr(wg, "FAILED", False)
    assert wg.use(q)
    got = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False, wide=True)
    assert not wg.FAILED
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    monkeypatch.setattr(wg, "ENABLED", False)  # DEEPINFER_ATTN_PREFILL=triton
    tiles = sparse_attention_gather(q, keys, idx, count, sink, scale, split=False, wide=True)
    rel, rel_max = _rel(got, tiles.double().cpu())
    assert rel < 2e-3 and rel_max < 2e-2, (rel, rel_max)
    rel, rel_max = _rel(got, _ref_attention(q, keys, idx, count, sink, scale))
    assert rel < 2e-2 and rel_max < 5e-2, (rel, rel_max)
    monkeypatch.setattr(wg, "ENABLED", True)
    one = sparse_attention_gather(q[5:6], keys, idx[5:6], count[5:6], sink, scale, split=False, wide=True)
    assert torch.equal(one, got[5:6])
    # int64 lists and counts (as the model's key lists come) give the same bits
    wide = sparse_attention_gather(q, keys, idx.long(), count.long(), sink, scale, split=False, wide=True)
    assert not wg.FAILED and torch.equal(wide, got)


@hopper_only
def test_gpu_paged_keys(monkeypatch):
    """Keys past the pool read through a page list (``kernels.paged_keys``): the same result as the gathered copy."""
    from deepinfer.kernels.paged_keys import gathered

    n, W, R, K = 64, 300, 16, 320
    q, pool, idx, count, sink, scale = _problem(n, W, K, [W] * n, seed=200)
    store = _randn(40, R, 512, seed=210, dtype=torch.bfloat16)
    pages = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:12].to(q.device)
    idx = torch.randint(0, K + 12 * R, (n, W), generator=torch.Generator().manual_seed(4)).to(q.device, torch.int32)
    monkeypatch.setattr(wg, "ENABLED", True)
    monkeypatch.setattr(wg, "FAILED", False)
    got = sparse_attention_gather(q, pool, idx, count, sink, scale, split=False, wide=True, paged=(store, pages))
    want = sparse_attention_gather(q, gathered(pool, (store, pages)), idx, count, sink, scale, split=False, wide=True)
    assert not wg.FAILED and torch.equal(got, want)


def test_wide_tiles_constants_agree():
    """The Gluon kernel is the wide tiles' stand-in: the same heads a program."""
    assert wg.BLOCK_H == attn.ATTN_WIDE["BLOCK_H"]
