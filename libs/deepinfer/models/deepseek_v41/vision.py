"""DeepSeek-V4.1 vision tower: the 2D-RoPE ViT and the 3×3 aligner (docs/deepseek_v41.md ("Vision tower")).

A plain-torch, CPU-runnable reference of the released encoder (= the DeepSeek-V4-Flash-Vision-Exp code that NeMo
AutoModel 0.7.0 reuses for V4.1). One image at a time, bidirectional attention over its patches:

    patches [vit_h*vit_w, 3, p, p] -> patch_embed -> blocks × L -> norm -> aligner -> [llm_h*llm_w, text hidden]

Module and parameter names are the released checkpoint names (docs/deepseek_v41.md ("Checkpoint names and formats")):
:class:`VisionEncoder` holds ``vision`` (:class:`VisionTransformer`) and ``aligner`` (:class:`VisionAligner`), so its
``state_dict`` keys are exactly ``vision.patch_embed.proj.*``,
``vision.blocks.{j}.{norm1,attn.wqkv,attn.wo,norm2,mlp.w1,mlp.w2}.*``, ``vision.norm.weight``, ``aligner.w1.*``,
``aligner.w2.*``. Norm weights are fp32 whatever the model dtype. Transport, batching across images and scheduling
belong to the vision-encoder service, not here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v41.config import DeepseekV41VisionConfig
from deepinfer.models.deepseek_v41.image import ImageFeatures, PreprocessedImage


def vision_rope_cos_sin(
    vit_h: int, vit_w: int, rope_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2D rotary table, fp32, each ``[vit_h*vit_w, 1, rope_dim]`` (``rope_dim`` = head_dim / 2).

    Frequencies ``theta^(-2i/rope_dim)``, ``i < rope_dim/2``; the first ``rope_dim/2`` angles are the patch's row
    index times them, the last ``rope_dim/2`` its column index times them. Patches are row-major.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    rows = torch.arange(vit_h, device=device).unsqueeze(1).expand(vit_h, vit_w)
    cols = torch.arange(vit_w, device=device).unsqueeze(0).expand(vit_h, vit_w)
    pos = torch.stack([rows, cols], dim=-1).reshape(-1, 2, 1).float()  # [N, (row, col), 1]
    angles = (pos * inv_freq).flatten(1)  # [N, rope_dim]: row angles then column angles
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of ``x [N, heads, head_dim]``: pairs ``(x[i], x[i + head_dim/2])``, fp32 arithmetic.

    So channel pairs ``i < head_dim/4`` turn with the row index and ``head_dim/4 <= i < head_dim/2`` with the
    column index (see :func:`vision_rope_cos_sin`). Returns ``x``'s dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionRMSNorm(nn.Module):
    """RMSNorm with an fp32 weight; statistics in fp32, output in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class PatchEmbed(nn.Module):
    """Linear embedding of flattened ``[3, p, p]`` RGB patches (channel-major, 588 = 3·14·14 values)."""

    def __init__(self, cfg: DeepseekV41VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=True, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    """Full bidirectional attention over one image's patches, 2D RoPE on Q and K, biased ``wqkv`` / ``wo``."""

    def __init__(self, cfg: DeepseekV41VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True, dtype=dtype)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """Bias-free SwiGLU: ``w1`` is ``[gate | up]`` (2·intermediate rows), ``w2`` maps back to hidden."""

    def __init__(self, cfg: DeepseekV41VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm residual block: ``x += attn(norm1(x)); x += mlp(norm2(x))``."""

    def __init__(self, cfg: DeepseekV41VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg, dtype)
        self.norm2 = VisionRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """The ViT (released ``vision.*``): patch embedding, ``num_hidden_layers`` blocks, final RMSNorm."""

    def __init__(self, cfg: DeepseekV41VisionConfig, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope_dim = cfg.hidden_size // cfg.num_attention_heads // 2
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = VisionRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``patches [vit_h*vit_w, 3, p, p]`` (row-major; cast to the weight dtype) -> ``[vit_h*vit_w, hidden]``."""
        p = self.cfg.patch_size
        if patches.ndim != 4 or tuple(patches.shape[1:]) != (3, p, p):
            raise ValueError(f"patches must have shape [n, 3, {p}, {p}], got {tuple(patches.shape)}")
        if vit_h <= 0 or vit_w <= 0 or patches.shape[0] != vit_h * vit_w:
            raise ValueError(f"expected {vit_h}x{vit_w}={vit_h * vit_w} patches, got {patches.shape[0]}")
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        cos, sin = vision_rope_cos_sin(vit_h, vit_w, self.rope_dim, self.cfg.rope_theta, device=x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class VisionAligner(nn.Module):
    """The 3×3 merger (released ``aligner.*``): ViT states -> text-hidden image features.

    The ``[vit_h, vit_w]`` grid is zero-padded at the bottom/right to multiples of ``r = downsample_ratio``; each
    ``r×r`` cell (cells row-major) becomes one vector of ``hidden·r²`` values ordered channel-major then row then
    column within the cell (``F.unfold`` order); then ``w2(gelu(w1(·)))`` with biases, exact (erf) GELU.
    """

    def __init__(self, cfg: DeepseekV41VisionConfig, text_hidden: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.ratio = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.ratio**2, text_hidden, bias=True, dtype=dtype)
        self.w2 = nn.Linear(text_hidden, text_hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``x [vit_h*vit_w, hidden]`` -> ``[ceil(vit_h/r)*ceil(vit_w/r), text_hidden]``, rows row-major."""
        if x.ndim != 2 or x.shape[0] != vit_h * vit_w:
            raise ValueError(f"expected [{vit_h * vit_w}, hidden] ViT states for a {vit_h}x{vit_w} grid, got {x.shape}")
        r = self.ratio
        llm_h, llm_w = math.ceil(vit_h / r), math.ceil(vit_w / r)
        grid = F.pad(x.reshape(vit_h, vit_w, -1), (0, 0, 0, llm_w * r - vit_w, 0, llm_h * r - vit_h))
        cells = grid.view(llm_h, r, llm_w, r, -1).permute(0, 2, 4, 1, 3).reshape(llm_h * llm_w, -1)
        return self.w2(F.gelu(self.w1(cells)))


class VisionEncoder(nn.Module):
    """ViT + aligner under the released names ``vision`` / ``aligner``: patches -> :class:`ImageFeatures`."""

    def __init__(self, cfg: DeepseekV41VisionConfig, text_hidden: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if cfg.num_hidden_layers == 0:
            raise ValueError("vision_config.num_hidden_layers is 0: this checkpoint has no vision tower")
        self.cfg = cfg
        self.text_hidden = text_hidden
        self.vision = VisionTransformer(cfg, dtype)
        self.aligner = VisionAligner(cfg, text_hidden, dtype)

    def forward(self, patches: torch.Tensor, vit_h: int, vit_w: int) -> torch.Tensor:
        """``[vit_h*vit_w, 3, p, p]`` -> ``[llm_h*llm_w, text_hidden]`` in the weight dtype."""
        return self.aligner(self.vision(patches, vit_h, vit_w), vit_h, vit_w)

    @torch.no_grad()
    def encode(self, image: PreprocessedImage) -> ImageFeatures:
        """Features of one preprocessed image (see :func:`deepinfer.models.deepseek_v41.image.preprocess_image`)."""
        feats = self(image.patches, image.vit_h, image.vit_w)
        return ImageFeatures(image.llm_h, image.llm_w, feats)
