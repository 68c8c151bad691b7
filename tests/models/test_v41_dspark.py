"""DSpark draft modules (stages, Markov head, confidence head) against NeMo AutoModel 0.7.0 (fp32, CPU).

The reference is NeMo's ``DeepseekV41DSparkModel`` built as the reference sketch does
(``DeepseekV41Config.build_dspark_draft``; its default backend: SDPA attention, torch experts; one case switches
NeMo's attention to its eager path), every weight randomised and copied into ours through NeMo's own export to the
released names (``state_dict_adapter.to_hf``). Both get the same random target features.

NeMo's training forward samples anchors and teacher-forces the Markov head with the sequence's next tokens. The
test pins the anchors and writes our greedy drafts into the sequence after each anchor, so NeMo's teacher-forced
logits are exactly our Markov-corrected logits and its argmax must reproduce our drafts. NeMo feeds the
confidence head the NORMED state: the parity test runs our drafter with ``confidence_input="normed"`` for that,
then checks the released ``"pre_norm"`` variant against NeMo's confidence head applied to the pre-norm state
(captured at the input of NeMo's final norm).

Blocks whose draft-MoE routing has a near-tie (biased top-k margin < ``ROUTE_TIE``) in any stage are screened out
(a flip would change the whole block); token equality is checked only where the top-2 logit gap exceeds ``TIE``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.models.deepseek_v41.dspark import DSparkDrafter, gather_window
from deepinfer.models.deepseek_v41.dspark_heads import temperature_sampler
from deepinfer.ops import get_ops
from models.tiny_v41 import build_tokenizer, text_config

ATOL_LOGITS = 1e-4
ATOL_CONF = 1e-5
TIE = 1e-5
ROUTE_TIE = 1e-4
SEQ = 20
# per batch row: anchors spaced > block so that each block's drafts can be written after its anchor; 0 and 2 lie
# inside the first window (sliding_window = 4 in the tiny configs), 0 has no context at all
ANCHORS = torch.tensor([[0, 4, 9, 14], [2, 7, 12, 16]])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def ops():
    return get_ops("cpu")


def _configs(nemo, tokenizer, name, **overrides):
    raw = dict(text_config(name, tokenizer), dtype="float32", **overrides)
    ntext = {k: v for k, v in raw.items() if k != "model_type"}
    ncfg = nemo["config"].DeepseekV41Config(
        text_config=ntext,
        vision_config={"num_hidden_layers": 0},
        image_token_id=tokenizer.convert_tokens_to_ids("<｜deepseek_image｜>"),
    )
    return DeepseekV41TextConfig.from_dict(raw), ncfg


def _nemo_draft(ncfg, num_anchors: int):
    tc = ncfg.text_config
    opts = SimpleNamespace(
        num_draft_layers=tc.num_nextn_predict_layers,
        target_layer_ids=tc.dspark_target_layer_ids,
        block_size=tc.dspark_block_size,
        num_anchors=num_anchors,
        mask_token_id=tc.dspark_noise_token_id,
        markov_rank=tc.dspark_markov_rank,
        markov_head_type="vanilla",
        confidence_head_alpha=1.0,
        confidence_head_with_markov=True,
        confidence_head_stop_gradient=False,
    )
    return ncfg.build_dspark_draft(opts).eval()


def _randomize(draft, g: torch.Generator) -> None:
    """Non-trivial values for every NeMo draft parameter (its own init is N(0, 0.02), zero sinks, unit norms)."""

    def rnd(t: torch.Tensor, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(t.shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(rnd(p, 0.2, 1.0))
            elif name.endswith("_hc.fn"):
                p.copy_(rnd(p, 0.1))
            elif name.endswith("_hc.base"):
                p.copy_(rnd(p, 0.5))
            elif name.endswith("_hc.scale"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("sinks_param.weight"):
                p.copy_(rnd(p, 0.5))
            elif ".ffn.gate." in name:
                p.copy_(rnd(p, 0.3))
            elif ".experts." in name:
                p.copy_(rnd(p, 0.1))
            elif name == "embed_tokens.weight" or name.endswith("markov_head.embed.weight"):
                p.copy_(rnd(p, 1.0))
            elif name == "lm_head.weight":
                p.copy_(rnd(p, 0.2))
            elif name.endswith("markov_head.head.weight"):
                p.copy_(rnd(p, 0.3))
            else:  # projections, confidence head
                p.copy_(rnd(p, p.shape[-1] ** -0.5))


def _load_released(ours: DSparkDrafter, released: dict[str, torch.Tensor]) -> None:
    """Copy released-name tensors (NeMo's ``to_hf`` export) into our drafter. Ours keeps the released names except
    where the backbone's module layout differs: ``hc_attn_fn`` → ``hc_attn.fn``, per-expert ``ffn.experts.{j}.wX``
    → stacked ``ffn.wX``, ``ffn.shared_experts.wX`` → ``ffn.shared_wX``."""
    sd, experts = {}, defaultdict(dict)
    for key, value in released.items():
        if key in ("embed.weight", "head.weight"):
            continue
        if m := re.fullmatch(r"(mtp\.\d+)\.hc_(attn|ffn)_(fn|base|scale)", key):
            key = f"{m[1]}.hc_{m[2]}.{m[3]}"
        elif m := re.fullmatch(r"(mtp\.\d+\.ffn)\.experts\.(\d+)\.(w[123])\.weight", key):
            experts[f"{m[1]}.{m[3]}"][int(m[2])] = value
            continue
        key = re.sub(r"\.ffn\.shared_experts\.(w[123])\.weight$", r".ffn.shared_\1.weight", key)
        sd[key] = value
    for key, rows in experts.items():
        sd[key] = torch.stack([rows[j] for j in range(len(rows))])
    ours.load_state_dict(sd, strict=True)


def _route_margins(ours: DSparkDrafter, ops) -> tuple[list, list]:
    """Forward hooks recording, per draft-MoE call, the biased top-k margin of every token."""
    margins, hooks = [], []

    def record(gate, args, _out) -> None:
        x = args[0]
        biased = gate.scores(x, ops) + gate.selection_bias(None)
        top = biased.topk(min(gate.topk + 1, biased.shape[-1]), dim=-1).values
        gap = (
            top[:, gate.topk - 1] - top[:, gate.topk] if top.shape[-1] > gate.topk else torch.full_like(top[:, 0], 1e9)
        )
        margins.append(gap)

    for stage in ours.mtp:
        hooks.append(stage.ffn.gate.register_forward_hook(record))
    return margins, hooks


def _our_draft(ours: DSparkDrafter, feats, ids, embed_w, head_w, ops):
    """Our drafts for every (row, anchor) of ANCHORS, one ``draft`` call over all blocks."""
    ctx, masks, anchors, positions = [[] for _ in ours.mtp], [], [], []
    for r in range(feats.shape[0]):
        main_x = ours.project(feats[r], ops)
        rows = ours.context_kv(main_x, torch.arange(feats.shape[1]), ops)
        p = ANCHORS[r]
        for k, kv in enumerate(rows):
            window, mask = gather_window(kv, p, ours.window)
            ctx[k].append(window)
        masks.append(mask)
        anchors.append(ids[r, p])
        positions.append(p)
    ctx = [torch.cat(c) for c in ctx]
    return ours.draft(torch.cat(anchors), torch.cat(positions), ctx, torch.cat(masks), embed_w, head_w, ops)


@pytest.mark.parametrize(
    ("name", "attn"), [("sketch", "sdpa"), ("heads8", "eager"), ("mixed", "sdpa")]
)  # 3, 2 and 1 stage(s); NeMo's default SDPA attention and its eager path
def test_v41_dspark_parity(nemo, tokenizer, ops, monkeypatch, name, attn):
    from nemo_automodel.components.models.deepseek_v41 import dspark as nemo_dspark

    cfg, ncfg = _configs(nemo, tokenizer, name)
    g = torch.Generator().manual_seed(100 + len(name))
    rows, n_anchor = ANCHORS.shape
    b, v, d = cfg.dspark_block_size, cfg.vocab_size, cfg.hidden_size
    draft = _nemo_draft(ncfg, n_anchor)
    for stage in draft.mtp:
        stage.attn.backend = dataclasses.replace(stage.attn.backend, attn=attn)
    _randomize(draft, g)
    ours = DSparkDrafter(cfg, confidence_input="normed")
    _load_released(ours, draft.state_dict_adapter.to_hf(draft.state_dict()))
    embed_w, head_w = draft.embed_tokens.weight.detach(), draft.lm_head.weight.detach()

    feats = torch.randn(rows, SEQ, ours.feature_dim, generator=g) * 2
    ids = torch.randint(5, v, (rows, SEQ), generator=g)
    margins, hooks = _route_margins(ours, ops)
    with torch.no_grad():
        res = _our_draft(ours, feats, ids, embed_w, head_w, ops)
    for h in hooks:
        h.remove()
    keep = torch.stack([m.view(-1, b).amin(1) for m in margins]).amin(0) > ROUTE_TIE  # per block
    assert keep.float().mean() >= 0.75, f"{int((~keep).sum())} blocks with routing near-ties: change the seed"

    # NeMo: pinned anchors, our drafts written after each anchor (teacher forcing = our Markov chain)
    ids2 = ids.clone()
    for r in range(rows):
        for a, p in enumerate(ANCHORS[r].tolist()):
            ids2[r, p + 1 : p + 1 + b] = res.tokens[r * n_anchor + a]
    pinned = (ANCHORS.clone(), torch.ones_like(ANCHORS, dtype=torch.bool))
    monkeypatch.setattr(nemo_dspark, "sample_anchor_positions", lambda **kw: pinned)
    seen = {}
    hook = draft.mtp[-1].norm.register_forward_hook(lambda m, a, out: seen.update(pre=a[0], normed=out))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        out = draft(ids2, feats, torch.ones_like(ids2))
        base_ref = draft.compute_logits(seen["normed"])
    hook.remove()

    flat = lambda t: t.reshape(rows * n_anchor, b, *t.shape[3:])  # noqa: E731  [rows, A, B, ...] -> [N, B, ...]
    assert torch.equal(flat(out.target_ids), res.tokens)  # NeMo's labels p+1..p+B are our drafts
    torch.testing.assert_close(res.hidden[keep], seen["pre"].view(-1, b, d)[keep], rtol=0, atol=ATOL_LOGITS)
    torch.testing.assert_close(res.base_logits[keep], base_ref.view(-1, b, v)[keep], rtol=0, atol=ATOL_LOGITS)
    torch.testing.assert_close(res.logits[keep], flat(out.draft_logits)[keep], rtol=0, atol=ATOL_LOGITS)
    top2 = res.logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1] > TIE) & keep.unsqueeze(1)
    assert clear.float().mean() >= 0.7
    assert torch.equal(flat(out.draft_logits).argmax(-1)[clear], res.tokens[clear])
    torch.testing.assert_close(
        res.confidence[keep], torch.sigmoid(flat(out.confidence_pred))[keep], rtol=0, atol=ATOL_CONF
    )

    # the released variant: the confidence head reads the pre-norm collapsed state
    ours.confidence_input = "pre_norm"
    with torch.no_grad():
        res_pre = _our_draft(ours, feats, ids, embed_w, head_w, ops)
        anchor_ids = torch.cat([ids[r, ANCHORS[r]] for r in range(rows)])
        prev_ids = torch.cat([anchor_ids.unsqueeze(1), res.tokens[:, :-1]], dim=1)
        _, emb = draft.mtp[-1].markov_head(prev_ids)
        conf_pre_ref = torch.sigmoid(draft.mtp[-1].confidence_head(seen["pre"].view(-1, b, d), emb))
    assert torch.equal(res_pre.tokens, res.tokens)
    torch.testing.assert_close(res_pre.confidence[keep], conf_pre_ref[keep], rtol=0, atol=ATOL_CONF)
    assert (res_pre.confidence - res.confidence).abs().max() > 1e-3  # the two inputs really differ


def test_v41_dspark_target_features(tokenizer, ops):
    """Stream mean per target layer, concatenated in layer order (the sketch's ``captured[k].mean(dim=2)``)."""
    cfg = DeepseekV41TextConfig.from_dict(text_config("sketch", tokenizer))
    ours = DSparkDrafter(cfg)
    g = torch.Generator().manual_seed(1)
    streams = [torch.randn(2, 5, cfg.hc_mult, cfg.hidden_size, generator=g) for _ in cfg.dspark_target_layer_ids]
    expected = torch.cat([s.mean(dim=2) for s in streams], dim=-1)
    assert torch.equal(ours.target_features(streams), expected)
    assert ours.target_features([s[0] for s in streams]).shape == (5, ours.feature_dim)


def test_v41_dspark_parameter_names(tokenizer):
    """Released ``mtp.{k}.*`` names with the backbone's per-block names; stage-owned heads on the first/last stage."""
    cfg = DeepseekV41TextConfig.from_dict(text_config("sketch", tokenizer))
    ours = DSparkDrafter(cfg)
    per_block = [
        "attn_norm.weight",
        "ffn_norm.weight",
        *(f"hc_{s}.{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")),
        *(f"attn.{w}.weight" for w in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")),
        "attn.attn_sink",
        *(f"ffn.gate.{p}" for p in ("weight", "bias", "bias_vl")),
        "ffn.w1",
        "ffn.w2",
        "ffn.w3",
        *(f"ffn.shared_w{i}.weight" for i in (1, 2, 3)),
    ]
    last = cfg.num_nextn_predict_layers - 1
    expected = {f"mtp.{k}.{n}" for k in range(cfg.num_nextn_predict_layers) for n in per_block}
    expected |= {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", f"mtp.{last}.norm.weight"}
    expected |= {f"mtp.{last}.markov_head.{n}.weight" for n in ("embed", "head")}
    expected |= {f"mtp.{last}.confidence_head.proj.weight"}
    sd = ours.state_dict()
    assert set(sd) == expected
    d, r, v = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size
    assert sd["mtp.0.main_proj.weight"].shape == (d, len(cfg.dspark_target_layer_ids) * d)
    assert sd[f"mtp.{last}.markov_head.embed.weight"].shape == (v, r)
    assert sd[f"mtp.{last}.markov_head.head.weight"].shape == (v, r)
    assert sd[f"mtp.{last}.confidence_head.proj.weight"].shape == (1, d + r)
    assert sd["mtp.1.ffn.w1"].shape == (cfg.dspark_n_routed_experts, cfg.moe_intermediate_size, d)


def _random_drafter(cfg, g):
    ours = DSparkDrafter(cfg)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            std = 0.3 if p.ndim == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if name.endswith("norm.weight") else 0.0))
    return ours


def test_v41_dspark_markov_chain_and_sampling(tokenizer, ops):
    """logits_k = U_k + markov(prev_k) with prev = [anchor, d_0..]; sampling: T→0 is greedy, rows with T=0 are
    greedy, a seeded generator reproduces; an empty batch works."""
    cfg = DeepseekV41TextConfig.from_dict(text_config("heads8", tokenizer))
    g = torch.Generator().manual_seed(7)
    ours = _random_drafter(cfg, g)
    v, d, n, c = cfg.vocab_size, cfg.hidden_size, 4, cfg.sliding_window
    embed_w, head_w = torch.randn(v, d, generator=g), torch.randn(v, d, generator=g) * 0.2
    anchors, pos = torch.randint(5, v, (n,), generator=g), torch.tensor([0, 3, 10, 30])
    main_x = ours.project(torch.randn(n, c, ours.feature_dim, generator=g), ops)
    ctx_pos = pos.unsqueeze(1) - c + torch.arange(c)
    ctx = [kv.view(n, c, -1) for kv in ours.context_kv(main_x.flatten(0, 1), ctx_pos.flatten(), ops)]
    mask = ctx_pos >= 0
    args = (anchors, pos, ctx, mask, embed_w, head_w, ops)
    with torch.no_grad():
        res = ours.draft(*args)
        prev = torch.cat([anchors.unsqueeze(1), res.tokens[:, :-1]], dim=1)
        bias, _ = ours.mtp[-1].markov_head(prev, ops)
        torch.testing.assert_close(res.logits, res.base_logits + bias, rtol=0, atol=1e-6)
        assert torch.equal(res.tokens, res.logits.argmax(-1))
        cold = ours.draft(*args, sampler=temperature_sampler(1e-6, torch.Generator().manual_seed(0)))
        assert torch.equal(cold.tokens, res.tokens)
        t = torch.tensor([0.0, 5.0, 0.0, 5.0])
        hot1 = ours.draft(*args, sampler=temperature_sampler(t, torch.Generator().manual_seed(3)))
        hot2 = ours.draft(*args, sampler=temperature_sampler(t, torch.Generator().manual_seed(3)))
        assert torch.equal(hot1.tokens, hot2.tokens)
        assert torch.equal(hot1.tokens[t == 0, 0], res.tokens[t == 0, 0])
        assert bool(((hot1.tokens >= 0) & (hot1.tokens < v)).all())
        assert ((hot1.confidence > 0) & (hot1.confidence < 1)).all()
        empty = ours.draft(anchors[:0], pos[:0], [x[:0] for x in ctx], mask[:0], embed_w, head_w, ops)
    assert empty.tokens.shape == (0, cfg.dspark_block_size) and empty.logits.shape == (0, cfg.dspark_block_size, v)


def test_v41_dspark_bad_inputs(tokenizer, ops):
    cfg = DeepseekV41TextConfig.from_dict(text_config("sketch", tokenizer))
    ours = DSparkDrafter(cfg)
    d, b, w = cfg.hidden_size, cfg.dspark_block_size, cfg.sliding_window
    with pytest.raises(ValueError, match=r"width 3 x 64 = 192"):
        ours.project(torch.zeros(5, 2 * d), ops)
    with pytest.raises(ValueError, match="expected 3 captured"):
        ours.target_features([torch.zeros(5, cfg.hc_mult, d)] * 2)
    with pytest.raises(ValueError, match="hc_mult"):
        ours.target_features([torch.zeros(5, cfg.hc_mult + 1, d)] * 3)
    with pytest.raises(ValueError, match="main_x"):
        ours.context_kv(torch.zeros(5, d + 1), torch.arange(5), ops)
    n = 2
    ctx = [torch.zeros(n, w, cfg.head_dim)] * len(ours.mtp)
    mask = torch.ones(n, w, dtype=torch.bool)
    emb = torch.zeros(cfg.vocab_size, d)
    pos = torch.tensor([5, 9])
    with pytest.raises(ValueError, match=rf"dspark_block_size={b}"):
        ours.hidden(torch.zeros(n, b + 1, dtype=torch.long), pos, ctx, mask, emb, ops)
    with pytest.raises(ValueError, match="one tensor per DSpark stage"):
        ours.draft(torch.zeros(n, dtype=torch.long), pos, ctx[:1], mask, emb, emb, ops)
    with pytest.raises(ValueError, match=r"ctx_kv\[0\] must have shape"):
        ours.draft(torch.zeros(n, dtype=torch.long), pos, [torch.zeros(n, w, 8)] * 3, mask, emb, emb, ops)
    with pytest.raises(ValueError, match="ctx_mask"):
        ours.draft(torch.zeros(n, dtype=torch.long), pos, ctx, mask.float(), emb, emb, ops)
    with pytest.raises(ValueError, match="positions"):
        ours.draft(torch.zeros(n, dtype=torch.long), pos[:1], ctx, mask, emb, emb, ops)
    with pytest.raises(ValueError, match="anchor positions"):
        gather_window(torch.zeros(4, cfg.head_dim), torch.tensor([5]), w)
    with pytest.raises(ValueError, match="confidence_input"):
        DSparkDrafter(cfg, confidence_input="final")
    no_draft = DeepseekV41TextConfig.from_dict(dict(text_config("sketch", tokenizer), num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="draft stages"):
        DSparkDrafter(no_draft)
