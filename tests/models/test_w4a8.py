"""``DEEPINFER_W4A8``: the routed experts take the official FP8 activations (1×128 blocks, power-of-two scales) and
nothing else changes; the worker's fingerprint tells its KV state apart from a worker without them."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.factory import build_worker
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.quant.w4a8 import uses_w4a8
from models.test_w8a8 import _logits


def test_the_variable_reaches_the_experts_and_the_fingerprint(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=4, overrides={"hidden_size": 128, "q_lora_rank": 128})  # 128-wide D
    ids = list(range(7, 47))
    with envs.override(DEEPINFER_W4A8=False):
        base = build_worker(path, dtype="float32", accelerator="cpu", num_pages=16)
    with envs.override(DEEPINFER_W4A8=True):
        w4 = build_worker(path, dtype="float32", accelerator="cpu", num_pages=16)
    assert not uses_w4a8(base.model) and uses_w4a8(w4.model)
    assert base.fingerprint != w4.fingerprint
    with envs.override(DEEPINFER_W4A8=True, DEEPINFER_W8A8=True):
        both = build_worker(path, dtype="float32", accelerator="cpu", num_pages=16)
    assert len({base.fingerprint, w4.fingerprint, both.fingerprint}) == 3
    a, b = _logits(base, ids), _logits(w4, ids)
    assert not torch.equal(a, b)
    moes = [m for m in base.model.modules() if isinstance(m, MoE)]
    assert moes
    for m in moes:  # the same rounding by the quantisation simulation's switch of the experts alone
        m.quant_sim = True
    assert torch.equal(_logits(base, ids), b)
