"""V4.1 vision tower and image input against NeMo AutoModel 0.7.0 (fp32, CPU).

* preprocessing + placeholder expansion vs ``DeepseekV41Processor`` (ids, types, grids, bf16 patches bit-equal),
  incl. the ``max_image_tokens`` shrink (both one-row/one-column corners) and the ``max_wh_ratio`` plain resize;
* ViT + aligner vs NeMo's ``DeepseekV41VisionTransformer`` / ``DeepseekV41VisionAligner`` (weights copied by name);
* the whole image-embedding path vs ``DeepseekV41Model._image_embeddings`` (batch of 2 prompts, 3 images);
* bad inputs raise ``ValueError`` naming the problem.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from deepinfer.checkpoint.references import nemo_backend
from deepinfer.models.deepseek_v41.config import DeepseekV41VisionConfig
from deepinfer.models.deepseek_v41.image import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEWLINE,
    IMAGE_START,
    TEXT,
    ImageFeatures,
    expand_image_placeholders,
    image_span_types,
    load_image,
    plan_image_grid,
    preprocess_image,
    splice_image_embeddings,
)
from deepinfer.models.deepseek_v41.vision import VisionAligner, VisionEncoder, VisionTransformer
from models.tiny_v41 import IMAGE_PLACEHOLDER, build_tokenizer, text_config

ATOL = 1e-5
TINY_VISION = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=48,
    patch_size=14,
    downsample_ratio=3,
    max_image_tokens=64,
    min_pixels=42 * 42,
)
VISION_CONFIGS = {
    "tiny": TINY_VISION,
    "flash": {},  # released V4.1 sizing: 1024 tokens, min 544², no max_wh_ratio
    "exp": dict(TINY_VISION, max_image_tokens=384, min_pixels=147456, max_wh_ratio=8.0),  # V4-Flash-Vision-Exp
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def text_raw(tokenizer):
    return {k: v for k, v in text_config("sketch", tokenizer).items() if k != "model_type"}


def _nemo_config(tokenizer, text_raw, vision: dict):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config(
        text_config=dict(text_raw, dtype="float32"),
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER),
        dtype="float32",
    )


def _image(width: int, height: int, seed: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    return img.convert(mode)


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            mean = 1.0 if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) else 0.0
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if mean else 0.2) + mean)


# -- processor ---------------------------------------------------------------------------------------------------
PROCESSOR_CASES = [
    ("tiny", [(70, 50), (50, 70)]),  # the reference sketch's image, and transposed
    ("tiny", [(14, 14), (97, 31, "RGBA")]),  # min_pixels upscale; odd sizes; alpha dropped
    ("tiny", [(500, 300), (150, 100)]),  # shrink, general branch; just fits
    ("tiny", [(4000, 20), (20, 4000, "L")]),  # shrink corners: one token row / one token column
    ("flash", [(640, 480), (1920, 1080)]),  # released sizing; 1920x1080 shrinks to <= 1024 tokens
    ("exp", [(2000, 100), (700, 300)]),  # max_wh_ratio clip + plain resize; pad
]
SHRINKS = {(500, 300), (4000, 20), (20, 4000), (1920, 1080)}  # the max_image_tokens shrink applies


@pytest.mark.parametrize(("vcfg", "sizes"), PROCESSOR_CASES)
def test_v41_parity_processor(nemo, tokenizer, text_raw, vcfg, sizes):
    """Expanded ids, vision_token_types, ViT grids and bf16 pixel patches equal DeepseekV41Processor's bit for bit."""
    from nemo_automodel.components.models.deepseek_v41.processing import DeepseekV41Processor

    ncfg = _nemo_config(tokenizer, text_raw, VISION_CONFIGS[vcfg])
    cfg = DeepseekV41VisionConfig(**VISION_CONFIGS[vcfg])
    processor = DeepseekV41Processor(tokenizer=tokenizer, config=ncfg)
    images = [_image(*s[:2], seed=i, mode=s[2] if len(s) > 2 else "RGB") for i, s in enumerate(sizes)]
    text = "w1 " + " w2 ".join([IMAGE_PLACEHOLDER] * len(images)) + " w3"
    ref = processor(text=text, images=images, return_tensors="pt")

    pre = [preprocess_image(img, cfg) for img in images]
    raw_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, types = expand_image_placeholders(raw_ids, pre, ncfg.image_token_id)
    assert ids == ref["input_ids"][0].tolist()
    assert types == ref["vision_token_types"][0].tolist()
    assert [[p.vit_h, p.vit_w] for p in pre] == ref["image_grid_hws"].tolist()
    patches = torch.cat([p.patches for p in pre])
    assert patches.dtype == ref["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(patches, ref["pixel_values"])
    for p in pre:
        assert (p.llm_h, p.llm_w) == (math.ceil(p.vit_h / 3), math.ceil(p.vit_w / 3))
        assert p.llm_h * (p.llm_w + 1) + 2 <= cfg.max_image_tokens
    unbounded = DeepseekV41VisionConfig(**dict(VISION_CONFIGS[vcfg], max_image_tokens=10**6))
    for s, p in zip(sizes, pre):
        full = plan_image_grid(s[0], s[1], unbounded)
        shrunk = full.llm_h * (full.llm_w + 1) + 2 > cfg.max_image_tokens
        assert shrunk == (tuple(s[:2]) in SHRINKS), s
        assert shrunk or (full.vit_h, full.vit_w) == (p.vit_h, p.vit_w)


def test_v41_preprocess_sources(tmp_path):
    """PNG bytes, a file path and the PIL image give the same patches; unknown sources are rejected."""
    cfg = DeepseekV41VisionConfig(**TINY_VISION)
    img = _image(61, 40, seed=5)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    (tmp_path / "x.png").write_bytes(buf.getvalue())
    a = preprocess_image(img, cfg)
    for src in (buf.getvalue(), tmp_path / "x.png", str(tmp_path / "x.png")):
        b = preprocess_image(src, cfg)
        assert torch.equal(a.patches, b.patches) and (a.vit_h, a.vit_w) == (b.vit_h, b.vit_w)
    assert preprocess_image(img, cfg, dtype=torch.float32).patches.dtype == torch.float32
    with pytest.raises(TypeError, match="unsupported image source"):
        load_image(12)


# -- ViT + aligner -----------------------------------------------------------------------------------------------
VIT_CASES = [
    (dict(TINY_VISION), [(4, 5), (3, 3), (7, 2), (1, 1)]),
    (dict(TINY_VISION, num_hidden_layers=3, hidden_size=48, num_attention_heads=3, rope_theta=100.0), [(5, 8)]),
    (
        dict(TINY_VISION, num_hidden_layers=1, hidden_size=64, num_attention_heads=4, patch_size=4, downsample_ratio=2),
        [(5, 3), (2, 6)],
    ),
]


@pytest.mark.parametrize(("vision", "grids"), VIT_CASES)
def test_v41_parity_vit_aligner(nemo, tokenizer, text_raw, vision, grids):
    """Our ViT and aligner (NeMo's weights loaded by name, strict) equal NeMo's modules within 1e-5 (fp32)."""
    from nemo_automodel.components.models.deepseek_v41.vision import (
        DeepseekV41VisionAligner,
        DeepseekV41VisionTransformer,
    )

    ncfg = _nemo_config(tokenizer, text_raw, vision)
    cfg = DeepseekV41VisionConfig(**vision)
    g = torch.Generator().manual_seed(7 + vision["hidden_size"])
    their_vit, their_al = DeepseekV41VisionTransformer(ncfg).eval(), DeepseekV41VisionAligner(ncfg).eval()
    _randomize(their_vit, g)
    _randomize(their_al, g)
    ours = VisionEncoder(cfg, ncfg.text_config.hidden_size, dtype=torch.float32).eval()
    theirs = {f"vision.{k}": v for k, v in their_vit.state_dict().items()}
    theirs |= {f"aligner.{k}": v for k, v in their_al.state_dict().items()}
    assert list(ours.state_dict()) == list(theirs)  # the released names, in order
    ours.load_state_dict(theirs, strict=True)
    assert ours.vision.norm.weight.dtype == ours.vision.blocks[0].norm1.weight.dtype == torch.float32
    p = cfg.patch_size
    for vit_h, vit_w in grids:
        patches = torch.randn(vit_h * vit_w, 3, p, p, generator=g)
        with torch.no_grad():
            ref_vit = their_vit(patches, vit_h, vit_w)
            ref = their_al(ref_vit, vit_h, vit_w)
            got_vit = ours.vision(patches, vit_h, vit_w)
            got = ours.aligner(got_vit, vit_h, vit_w)
        torch.testing.assert_close(got_vit, ref_vit, rtol=0, atol=ATOL)
        torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
        r = cfg.downsample_ratio
        assert got.shape == (math.ceil(vit_h / r) * math.ceil(vit_w / r), ncfg.text_config.hidden_size)


def test_v41_parity_vit_aligner_bf16(nemo, tokenizer, text_raw):
    """In the released bf16 (norm weights fp32) our tower is bit-identical to NeMo's on CPU."""
    from nemo_automodel.components.models.deepseek_v41.vision import (
        DeepseekV41VisionAligner,
        DeepseekV41VisionTransformer,
    )

    vision = dict(TINY_VISION, num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    ncfg = _nemo_config(tokenizer, text_raw, vision)
    ncfg.dtype = "bfloat16"
    g = torch.Generator().manual_seed(5)
    their_vit, their_al = DeepseekV41VisionTransformer(ncfg).eval(), DeepseekV41VisionAligner(ncfg).eval()
    assert their_vit.patch_embed.proj.weight.dtype == torch.bfloat16
    ours = VisionEncoder(DeepseekV41VisionConfig(**vision), ncfg.text_config.hidden_size).eval()
    state = {f"vision.{k}": v for k, v in their_vit.state_dict().items()}
    ours.load_state_dict(state | {f"aligner.{k}": v for k, v in their_al.state_dict().items()}, strict=True)
    patches = torch.randn(35, 3, 14, 14, generator=g).bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(patches, 5, 7), their_al(their_vit(patches, 5, 7), 5, 7))


def test_v41_released_parameter_names():
    """The state_dict keys are the released checkpoint names (docs/deepseek_v41.md, "Checkpoint names and formats")."""
    enc = VisionEncoder(DeepseekV41VisionConfig(**dict(TINY_VISION, num_hidden_layers=1)), 16)
    assert list(enc.state_dict()) == [
        "vision.patch_embed.proj.weight",
        "vision.patch_embed.proj.bias",
        "vision.blocks.0.norm1.weight",
        "vision.blocks.0.attn.wqkv.weight",
        "vision.blocks.0.attn.wqkv.bias",
        "vision.blocks.0.attn.wo.weight",
        "vision.blocks.0.attn.wo.bias",
        "vision.blocks.0.norm2.weight",
        "vision.blocks.0.mlp.w1.weight",
        "vision.blocks.0.mlp.w2.weight",
        "vision.norm.weight",
        "aligner.w1.weight",
        "aligner.w1.bias",
        "aligner.w2.weight",
        "aligner.w2.bias",
    ]
    assert enc.aligner.w1.weight.shape == (16, 32 * 9) and enc.vision.blocks[0].mlp.w1.weight.shape == (96, 32)
    assert enc.vision.norm.weight.dtype == torch.float32 and enc.aligner.w1.weight.dtype == torch.bfloat16


def test_v41_flash_shapes_match_checkpoint_names():
    """At the released Flash sizes (meta device) names, shapes and dtypes equal the checkpoint name table."""
    from deepinfer.checkpoint.names_v41 import expected_tensors
    from deepinfer.models.deepseek_v41.config import DeepseekV41Config

    cfg = DeepseekV41Config()
    with torch.device("meta"):
        enc = VisionEncoder(cfg.vision_config, cfg.text_config.hidden_size)
    ours = {k: (tuple(v.shape), v.dtype) for k, v in enc.state_dict().items()}
    table = {
        k: (v.shape, v.stored(k)[0][2])
        for k, v in expected_tensors(cfg).items()
        if k.startswith(("vision.", "aligner."))
    }
    assert ours == table
    assert ours["vision.patch_embed.proj.weight"] == ((1024, 588), torch.bfloat16)
    assert ours["aligner.w1.weight"][0] == (5120, 9216) and len(enc.vision.blocks) == 32


# -- splice ------------------------------------------------------------------------------------------------------
def test_v41_parity_image_embeddings(nemo, tokenizer, text_raw):
    """preprocess, expand, VisionEncoder, splice == NeMo DeepseekV41Model._image_embeddings (2 rows, 3 images)."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.processing import DeepseekV41Processor

    ncfg = _nemo_config(tokenizer, text_raw, TINY_VISION)
    model = DeepseekV41ForCausalLM(ncfg, backend=nemo_backend(), tokenizer=tokenizer).model.eval()
    g = torch.Generator().manual_seed(21)
    _randomize(model.vision, g)
    _randomize(model.aligner, g)
    with torch.no_grad():
        for p in (model.embed_tokens.weight, model.image_start, model.image_newline, model.image_end):
            p.copy_(torch.randn(p.shape, generator=g))
    texts = [f"w1 {IMAGE_PLACEHOLDER} w2 w3 {IMAGE_PLACEHOLDER}", f"{IMAGE_PLACEHOLDER} w4"]
    images = [[_image(70, 50, 1), _image(30, 90, 2)], [_image(200, 120, 3)]]
    batch = DeepseekV41Processor(tokenizer=tokenizer, config=ncfg)(
        text=texts, images=images, return_tensors="pt", padding=True
    )
    with torch.no_grad():
        ref = model._image_embeddings(
            batch["input_ids"], batch["pixel_values"], batch["image_grid_hws"], batch["vision_token_types"]
        )

    cfg = DeepseekV41VisionConfig(**TINY_VISION)
    enc = VisionEncoder(cfg, ncfg.text_config.hidden_size, dtype=torch.float32).eval()
    enc.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith(("vision.", "aligner."))})
    for row, (text, imgs) in enumerate(zip(texts, images)):
        pre = [preprocess_image(img, cfg) for img in imgs]
        feats = [enc.encode(p) for p in pre]
        raw = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, types = expand_image_placeholders(raw, feats, ncfg.image_token_id)
        embeds = model.embed_tokens.weight.detach()[torch.tensor(ids)]
        got = splice_image_embeddings(embeds, types, feats, model.image_start, model.image_newline, model.image_end)
        n = len(ids)
        assert ids == batch["input_ids"][row, :n].tolist() and types == batch["vision_token_types"][row, :n].tolist()
        torch.testing.assert_close(got, ref[row, :n], rtol=0, atol=ATOL)
        assert torch.equal(got[torch.tensor(types) == TEXT], embeds[torch.tensor(types) == TEXT])
        assert not torch.equal(got, embeds)  # a copy, the input is untouched


def test_v41_splice_layout():
    """Features go row-major into the IMG positions, delimiters into START/NEWLINE/END, text rows untouched."""
    d = 4
    ids, types = expand_image_placeholders([5, 9, 6, 9], [(2, 3), (1, 1)], image_token_id=9)
    assert ids == [5] + [9] * 10 + [6] + [9] * 4
    assert types == [TEXT] + image_span_types(2, 3) + [TEXT] + [0, 1, 2, 3]
    assert image_span_types(2, 3) == [IMAGE_START, 1, 1, 1, IMAGE_NEWLINE, 1, 1, 1, IMAGE_NEWLINE, IMAGE_END]
    embeds = torch.zeros(len(ids), d)
    f0 = ImageFeatures(2, 3, torch.arange(6.0).unsqueeze(1).expand(6, d) + 10)
    f1 = torch.full((1, d), 99.0)
    s, nl, e = torch.full((d,), -1.0), torch.full((d,), -2.0), torch.full((d,), -3.0)
    out = splice_image_embeddings(embeds, torch.tensor(types), [f0, f1], s, nl, e, inplace=True)
    assert out is embeds
    assert out[:, 0].tolist() == [0, -1, 10, 11, 12, -2, 13, 14, 15, -2, -3, 0, -1, 99, -2, -3]
    assert splice_image_embeddings(torch.zeros(2, d), [TEXT, TEXT], [], s, nl, e).abs().sum() == 0


# -- bad inputs --------------------------------------------------------------------------------------------------
def _splice_args(d: int = 4):
    ids, types = expand_image_placeholders([5, 9, 6], [(2, 2)], image_token_id=9)
    vec = torch.zeros(d)
    return torch.zeros(len(ids), d), types, vec


def test_v41_bad_inputs():
    cfg = DeepseekV41VisionConfig(**TINY_VISION)
    with pytest.raises(ValueError, match=r"2 image placeholder token\(s\) \(id 9\) but 1 image"):
        expand_image_placeholders([9, 1, 9], [(1, 1)], image_token_id=9)
    with pytest.raises(ValueError, match="positive integers"):
        expand_image_placeholders([9], [(0, 3)], image_token_id=9)
    with pytest.raises(ValueError, match=r"llm_h\*llm_w=6"):
        ImageFeatures(2, 3, torch.zeros(5, 4))
    with pytest.raises(ValueError, match="llm_w must be a positive integer"):
        ImageFeatures(2, 0, torch.zeros(0, 4))

    embeds, types, vec = _splice_args()
    with pytest.raises(ValueError, match=r"1 image span\(s\) in vision_token_types but 2 feature set\(s\)"):
        splice_image_embeddings(embeds, types, [torch.zeros(4, 4)] * 2, vec, vec, vec)
    with pytest.raises(ValueError, match=r"image 0: features must be \[rows, 4\] \(embedding width\)"):
        splice_image_embeddings(embeds, types, [torch.zeros(4, 5)], vec, vec, vec)
    with pytest.raises(ValueError, match="image 0: 3 feature rows but the span has 2x2"):
        splice_image_embeddings(embeds, types, [torch.zeros(3, 4)], vec, vec, vec)
    with pytest.raises(ValueError, match="features are for a 1x4 grid, span is 2x2"):
        splice_image_embeddings(embeds, types, [ImageFeatures(1, 4, torch.zeros(4, 4))], vec, vec, vec)
    with pytest.raises(ValueError, match=r"image_newline must have shape \[4\]"):
        splice_image_embeddings(embeds, types, [torch.zeros(4, 4)], vec, torch.zeros(5), vec)
    with pytest.raises(ValueError, match="must have shape"):
        splice_image_embeddings(embeds[:-1], types, [torch.zeros(4, 4)], vec, vec, vec)
    broken = list(types)
    broken[3] = IMAGE_NEWLINE  # a row of width 1 then one of width 2
    with pytest.raises(ValueError, match="is not"):
        splice_image_embeddings(embeds, broken, [torch.zeros(4, 4)], vec, vec, vec)
    with pytest.raises(ValueError, match="outside complete"):
        splice_image_embeddings(embeds, [IMAGE] + list(types[1:]), [], vec, vec, vec)
    with pytest.raises(ValueError, match="IMAGE_START but"):
        splice_image_embeddings(embeds, list(types[:-2]) + [TEXT, TEXT], [torch.zeros(4, 4)], vec, vec, vec)
    with pytest.raises(ValueError, match="values must be in"):
        splice_image_embeddings(embeds, [7] * len(types), [], vec, vec, vec)
    assert IMAGE_END == 3

    with pytest.raises(ValueError, match="image size must be positive"):
        plan_image_grid(0, 10, cfg)
    with pytest.raises(ValueError, match="max_image_tokens must be >= 4"):
        plan_image_grid(10, 10, DeepseekV41VisionConfig(**dict(TINY_VISION, max_image_tokens=3)))
    vit = VisionTransformer(cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expected 2x3=6 patches, got 5"):
        vit(torch.zeros(5, 3, 14, 14), 2, 3)
    with pytest.raises(ValueError, match=r"patches must have shape \[n, 3, 14, 14\]"):
        vit(torch.zeros(6, 3, 7, 7), 2, 3)
    with pytest.raises(ValueError, match="ViT states"):
        VisionAligner(cfg, 8, dtype=torch.float32)(torch.zeros(5, 32), 2, 3)
    with pytest.raises(ValueError, match="no vision tower"):
        VisionEncoder(DeepseekV41VisionConfig(**dict(TINY_VISION, num_hidden_layers=0)), 8)
