"""V4.1 single-pass (lagged) mHC and modality-aware MoE against NeMo AutoModel 0.7.0's modules (fp32, CPU).

NeMo's ``DeepseekV41Block`` runs with its real mHC, norms and MoE and a per-token stub in place of CSA2 attention
(attention is a later step), so tokens stay independent and a near-tie in one token's routing cannot leak into
another: tokens whose biased top-k margin falls under ``TIE_MARGIN`` in any layer are screened out.
NeMo's clamped SwiGLU is ``torch.compile``d; the tests run it eagerly (same math, no compile time).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deepinfer.checkpoint.references import nemo_backend
from deepinfer.models.deepseek_v4.layers import RMSNorm
from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.mhc import (
    HyperConnection,
    embed_streams,
    final_collapse,
    initial_pre,
    lagged_sublayer,
)
from deepinfer.models.deepseek_v41.moe import MoE
from deepinfer.ops import get_ops
from models.tiny_v41 import build_tokenizer, text_config

ATOL = 1e-5
TIE_MARGIN = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def ops():
    return get_ops("cpu")


def _configs(nemo, tokenizer, name, **overrides):
    raw = dict(text_config(name, tokenizer), dtype="float32", **overrides)
    ncfg = nemo["config"].DeepseekV41TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    return DeepseekV41TextConfig.from_dict(raw), ncfg


def _moe_config(ncfg):
    """As NeMo's ``DeepseekV41ForCausalLM`` builds it."""
    from nemo_automodel.components.moe.config import MoEConfig

    return MoEConfig(
        dim=ncfg.hidden_size,
        inter_dim=ncfg.moe_intermediate_size,
        moe_inter_dim=ncfg.moe_intermediate_size,
        n_routed_experts=ncfg.n_routed_experts,
        n_shared_experts=ncfg.n_shared_experts,
        n_activated_experts=ncfg.num_experts_per_tok,
        n_expert_groups=0,
        n_limited_groups=0,
        train_gate=True,
        gate_bias_update_factor=0.0,
        aux_loss_coeff=0.0,
        score_func="sqrtsoftplus",
        route_scale=ncfg.routed_scaling_factor,
        norm_topk_prob=ncfg.norm_topk_prob,
        router_weights_fp32=True,
        force_e_score_correction_bias=True,
        swiglu_limit=ncfg.swiglu_limit,
        dtype=torch.float32,
    )


class _StubAttention(nn.Module):
    """Per-token stand-in for CSA2 attention, with NeMo's attention call signature."""

    def __init__(self, dim: int, g: torch.Generator) -> None:
        super().__init__()
        self.w = torch.randn(dim, dim, generator=g) * 0.15

    def forward(self, x: torch.Tensor, **kw) -> SimpleNamespace:
        return SimpleNamespace(hidden_states=torch.tanh(x @ self.w.T), state=kw.get("state"))


def _randomize_block(blk, g: torch.Generator) -> None:
    def fill(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    with torch.no_grad():
        for hc in (blk.attn_hc, blk.ffn_hc):
            fill(hc.fn, 0, 0.1)
            fill(hc.base, 0, 0.5)
            hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
        for norm in (blk.attn_norm, blk.ffn_norm):
            fill(norm.weight, 1, 0.2)
        gate = blk.ffn.gate
        fill(gate.weight, 0, 0.3)
        fill(gate.e_score_correction_bias, 0, 0.3)
        fill(gate.bias_vl, 0, 0.3)
        fill(blk.ffn.experts.gate_and_up_projs, 0, 0.1)
        fill(blk.ffn.experts.down_projs, 0, 0.1)
        for p in blk.ffn.shared_experts.parameters():
            fill(p, 0, 0.1)


def _load_hc(ours: HyperConnection, theirs) -> HyperConnection:
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            getattr(ours, name).copy_(getattr(theirs, name))
    return ours


def _load_moe(ours: MoE, theirs) -> MoE:
    i = ours.w1.shape[1]
    gup, down = theirs.experts.gate_and_up_projs, theirs.experts.down_projs  # [E, D, 2I] (gate | up), [E, I, D]
    sh = theirs.shared_experts
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.gate.bias.copy_(theirs.gate.e_score_correction_bias)
        ours.gate.bias_vl.copy_(theirs.gate.bias_vl)
        ours.w1.copy_(gup[..., :i].transpose(1, 2))
        ours.w3.copy_(gup[..., i:].transpose(1, 2))
        ours.w2.copy_(down.transpose(1, 2))
        ours.shared_w1.weight.copy_(sh.gate_proj.weight)
        ours.shared_w3.weight.copy_(sh.up_proj.weight)
        ours.shared_w2.weight.copy_(sh.down_proj.weight)
    return ours


def _attend(attn: _StubAttention, norm: RMSNorm, ops, x: torch.Tensor) -> torch.Tensor:
    return attn(norm(x, ops)).hidden_states


def _nemo_block(nemo, cfg, ncfg, layer: int, g: torch.Generator):
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41Block

    blk = DeepseekV41Block(ncfg, layer, nemo_backend(), _moe_config(ncfg)).eval()
    assert blk.engram is None, "pick layers without Engram"
    blk.attn = _StubAttention(cfg.hidden_size, g)
    _randomize_block(blk, g)
    return blk


def _margins(moe: MoE, x: torch.Tensor, image_mask: torch.Tensor | None, ops) -> torch.Tensor:
    """Gap between the k-th and (k+1)-th biased score per token (``inf`` when k = E)."""
    biased = moe.gate.scores(x, ops) + moe.gate.selection_bias(image_mask)
    k = moe.gate.topk
    if k == biased.shape[-1]:
        return torch.full(biased.shape[:1], float("inf"))
    top = biased.topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def _image_mask(g: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[:, 2:7] = True  # an image span ...
    return mask | (torch.rand(batch, seq, generator=g) < 0.15)  # ... and scattered vision tokens


@pytest.mark.parametrize("name", ["sketch", "mixed"])
def test_v41_mhc_parity(nemo, tokenizer, ops, name):
    """Coefficients (pre, post, Sinkhorn comb), collapse and expand equal NeMo's DeepseekV41HyperConnection."""
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    cfg, ncfg = _configs(nemo, tokenizer, name)
    assert cfg.rms_norm_eps == 1e-20  # the mHC RMS statistic uses it too
    g = torch.Generator().manual_seed(3 + len(name))
    theirs = DeepseekV41HyperConnection(ncfg)
    with torch.no_grad():
        theirs.fn.copy_(torch.randn(theirs.fn.shape, generator=g) * 0.1)
        theirs.base.copy_(torch.randn(theirs.base.shape, generator=g) * 0.5)
        theirs.scale.copy_(torch.rand(3, generator=g) + 0.5)
    ours = _load_hc(HyperConnection(cfg), theirs)
    n, d = cfg.hc_mult, cfg.hidden_size
    h = torch.randn(2, 7, n, d, generator=g) * torch.rand(2, 7, n, 1, generator=g) * 3
    with torch.no_grad():
        expected = theirs(h)
        got = ours(h.flatten(0, 1), ops)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b.flatten(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.comb.sum(-2), torch.ones(14, n), rtol=0, atol=1e-4)  # doubly stochastic
    y = torch.randn(2, 7, d, generator=g)
    pre = torch.rand(2, 7, n, generator=g)
    torch.testing.assert_close(
        ops.hc_collapse(h.flatten(0, 1), pre.flatten(0, 1)),
        DeepseekV41HyperConnection.collapse(h, pre).flatten(0, 1),
        rtol=0,
        atol=ATOL,
    )
    torch.testing.assert_close(
        ops.hc_expand(y.flatten(0, 1), h.flatten(0, 1), got.post, got.comb),
        DeepseekV41HyperConnection.expand(y, h, expected).flatten(0, 1),
        rtol=0,
        atol=ATOL,
    )


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("sketch", {}),
        ("mixed", {"swiglu_limit": 1.5, "n_routed_experts": 16, "num_experts_per_tok": 3}),
        ("heads8", {"num_experts_per_tok": 1}),  # top-1: no renormalisation (as NeMo)
    ],
)
def test_v41_moe_parity(nemo, tokenizer, ops, name, overrides):
    """Gate choices/weights (text and image tokens) and the MoE output equal NeMo's (clamp hit when limit=1.5)."""
    cfg, ncfg = _configs(nemo, tokenizer, name, **overrides)
    limit = overrides.get("swiglu_limit")
    g = torch.Generator().manual_seed(11 + len(name))
    layer = min(set(range(cfg.num_hidden_layers)) - set(cfg.engram_layer_ids))
    blk = _nemo_block(nemo, cfg, ncfg, layer, g)
    ours = _load_moe(MoE(cfg), blk.ffn)
    x = torch.randn(3, 16, cfg.hidden_size, generator=g)
    mask = _image_mask(g, 3, 16)
    flat, fmask = x.flatten(0, 1), mask.flatten()
    keep = _margins(ours, flat, fmask, ops) > TIE_MARGIN
    assert keep.float().mean() > 0.9, f"{int((~keep).sum())} near-ties: change the seed"
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        blk.ffn.gate.set_routing_context(None, mask.to(torch.int32) - 1)
        w_ref, idx_ref, _ = blk.ffn.gate(flat, torch.ones(48, dtype=torch.bool), None)
        blk.ffn.gate.set_routing_context(None, mask.to(torch.int32) - 1)
        y_ref = blk.ffn(x).flatten(0, 1)
        idx, w = ours.gate(flat, fmask, ops)
        y = ours(flat, fmask, ops)
    assert torch.equal(idx[keep], idx_ref[keep])
    torch.testing.assert_close(w[keep], w_ref[keep], rtol=0, atol=ATOL)
    torch.testing.assert_close(y[keep], y_ref[keep], rtol=0, atol=ATOL)
    # bias_vl really routes the image tokens: with text bias everywhere, some image token picks other experts
    idx_text, _ = ours.gate(flat, None, ops)
    assert torch.equal(idx_text[~fmask], idx[~fmask]) and not torch.equal(idx_text[fmask], idx[fmask])
    if limit is not None:  # the clamp is active in the shared expert as well
        sh = blk.ffn.shared_experts
        assert bool((sh.gate_proj(flat).abs() > limit).any() and (sh.up_proj(flat).abs() > limit).any())


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize(("name", "layers"), [("sketch", (0, 2, 4, 5)), ("mixed", (1, 3, 4))])
def test_v41_lagged_blocks_parity(nemo, tokenizer, name, layers, batch_invariant):
    """A stack of NeMo DeepseekV41Blocks (attention stubbed) equals the lagged mHC hand-off around our MoE:
    the streams and the carried ``pre`` after every block, and the final collapse (both CPU op sets)."""
    ops = get_ops("cpu", batch_invariant=batch_invariant)
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    cfg, ncfg = _configs(nemo, tokenizer, name)
    g = torch.Generator().manual_seed(5 + len(name))
    batch, seq, n, d = 2, 12, cfg.hc_mult, cfg.hidden_size
    emb = torch.randn(batch, seq, d, generator=g)
    mask = _image_mask(g, batch, seq)
    fmask = mask.flatten()
    h_ref = emb.unsqueeze(2).expand(-1, -1, n, -1)
    pre_ref = torch.zeros(batch, seq, n)
    pre_ref[..., 0] = 1
    h, pre = embed_streams(emb.flatten(0, 1), n), initial_pre(batch * seq, n)
    keep = torch.ones(batch * seq, dtype=torch.bool)
    pos = torch.arange(seq).expand(batch, -1)
    for layer in layers:
        blk = _nemo_block(nemo, cfg, ncfg, layer, g)
        attn_hc, ffn_hc = _load_hc(HyperConnection(cfg), blk.attn_hc), _load_hc(HyperConnection(cfg), blk.ffn_hc)
        attn_norm, ffn_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        attn_norm.weight.copy_(blk.attn_norm.weight)
        ffn_norm.weight.copy_(blk.ffn_norm.weight)
        moe = _load_moe(MoE(cfg), blk.ffn)

        def ffn(x, moe=moe, ffn_norm=ffn_norm):
            xn = ffn_norm(x, ops)
            keep.logical_and_(_margins(moe, xn, fmask, ops) > TIE_MARGIN)
            return moe(xn, fmask, ops)

        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            h_ref, pre_ref, _ = blk(h_ref, pre_ref, None, position_ids=pos, image_mask=mask)
            h, pre = lagged_sublayer(h, pre, attn_hc, partial(_attend, blk.attn, attn_norm, ops), ops)
            h, pre = lagged_sublayer(h, pre, ffn_hc, ffn, ops)
        assert keep.float().mean() > 0.8, "too many near-ties: change the seed"
        torch.testing.assert_close(h[keep], h_ref.flatten(0, 1)[keep], rtol=0, atol=ATOL)
        torch.testing.assert_close(pre[keep], pre_ref.flatten(0, 1)[keep], rtol=0, atol=ATOL)
    out = final_collapse(h, pre, ops)
    expected = DeepseekV41HyperConnection.collapse(h_ref, pre_ref).flatten(0, 1)
    torch.testing.assert_close(out[keep], expected[keep], rtol=0, atol=ATOL)


def test_v41_gate_tie_rule_and_renorm(ops):
    """Exact ties go to the lower expert id; weights renormalise (+1e-20) only for top-k > 1; draft sizes."""
    cfg = DeepseekV41TextConfig.from_dict(text_config("sketch"))
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.bias_vl[5] = 1.0
    x = torch.randn(4, cfg.hidden_size)
    idx, w = moe.gate(x, torch.tensor([False, True, False, True]), ops)
    assert idx.tolist() == [[0, 1], [5, 0], [0, 1], [5, 0]]
    torch.testing.assert_close(w, torch.full((4, 2), cfg.routed_scaling_factor / 2))
    one = MoE(cfg, topk=1)
    one.gate.weight.data.zero_()
    _, w1 = one.gate(x, None, ops)
    torch.testing.assert_close(w1, torch.nn.functional.softplus(torch.zeros(4, 1)).sqrt() * cfg.routed_scaling_factor)
    draft = MoE.draft(cfg)
    assert draft.w1.shape[0] == cfg.dspark_n_routed_experts and draft.gate.topk == cfg.dspark_num_experts_per_tok
    with pytest.raises(ValueError, match="top-k"):
        MoE(cfg, topk=cfg.n_routed_experts + 1)
