"""NeMo AutoModel's DeepseekV41ForCausalLM as a CPU reference for whole-model parity, and our model with its weights.

- ``build_pair(name)`` builds NeMo's model (fp32, eager attention, torch MoE, random weights with non-trivial sinks,
  gate biases, mHC and norms) on a tiny config of ``tiny_v41`` and our :class:`DeepseekV41Model` with the same
  weights (copied by name: the released names are ours; NeMo's are mapped here).
- NeMo runs on its plain-torch backend (``deepinfer.checkpoint.references.nemo_backend``).
- ``reference_rules()``: the two switches the parity tests run NeMo under.
  * ``cache_quant=False`` makes NeMo's ``quantize_cache`` the identity (ours is switched off with
    ``set_quant_sim(False)``): rounding flips in the FP8/FP4 caches amplify op-order differences of ~1e-6, so
    most comparisons run without them (ISSUE 7's "bound below"); a few short prompts run with them.
  * ``torch.Tensor.topk`` with the documented tie rule (equal scores to the lower index). NeMo calls plain
    ``topk``, whose choice among equal values depends on the row width, and ReLU makes exact-zero indexer
    scores common; with the rule both sides select the same rows.
- ``record_cache_rounds()`` / ``replay_cache_rounds(ops, log)``: NeMo's cache roundings (input and output of every
  ``quantize_cache`` call) and our ``ops.cache_round`` returning NeMo's output for the call whose input matches
  ours: the rounding-boundary ties of the cache formats broken the same way on both sides (docs/parity.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer.checkpoint.references import nemo_backend
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import compressed_token_map
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.ops import get_ops
from models.tiny_v41 import IMAGE_PLACEHOLDER, text_config

_TOPK = torch.Tensor.topk


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch's signature
    order = torch.sort(self, dim=dim, descending=largest, stable=True)
    vals, idx = order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)
    return torch.return_types.topk((vals, idx))


@contextlib.contextmanager
def reference_rules(cache_quant: bool = False) -> Iterator[None]:
    from nemo_automodel.components.models.deepseek_v41 import attention, indexer  # noqa: F401

    saved = attention.quantize_cache
    try:
        torch.Tensor.topk = _stable_topk
        if not cache_quant:
            attention.quantize_cache = lambda values, **_: values
        yield
    finally:
        torch.Tensor.topk = _TOPK
        attention.quantize_cache = saved


@contextlib.contextmanager
def record_cache_rounds() -> Iterator[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """``(format, input, output)`` of every ``quantize_cache`` call NeMo makes (rows flattened, fp32)."""
    from nemo_automodel.components.models.deepseek_v41 import attention

    saved, log = attention.quantize_cache, []

    def recording(values, *, format, block_size):  # noqa: A002 - NeMo's signature
        out = saved(values, format=format, block_size=block_size)
        log.append((format, values.detach().float().flatten(0, -2), out.detach().float().flatten(0, -2)))
        return out

    attention.quantize_cache = recording
    try:
        yield log
    finally:
        attention.quantize_cache = saved


@contextlib.contextmanager
def replay_cache_rounds(ops, log: list[tuple[str, torch.Tensor, torch.Tensor]]) -> Iterator[dict[str, int]]:
    """Our ``ops.cache_round(x, fmt)`` returns NeMo's rounding of the logged call of that format whose input equals
    ``x`` within op-order noise (rtol 1e-4); yields ``{"replayed": n, "own": n}`` (calls without a match round
    themselves)."""
    own, saved = ops.cache_round, vars(ops).get("cache_round")
    used, counts = set(), {"replayed": 0, "own": 0}

    def cache_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
        flat = x.detach().float().flatten(0, -2)
        for i, (f, inp, out) in enumerate(log):
            if i not in used and f == fmt and inp.shape == flat.shape and torch.allclose(inp, flat, 1e-4, 1e-5):
                used.add(i)
                counts["replayed"] += 1
                return out.view(x.shape).to(x.dtype)
        counts["own"] += 1
        return own(x, fmt)

    ops.cache_round = cache_round
    try:
        yield counts
    finally:
        if saved is None:
            del ops.cache_round
        else:
            ops.cache_round = saved


# a tiny vision tower (the reference sketch's): 14-px patches, 3x3 merge, at least 42x42 pixels
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


def composite(name: str, tokenizer, vision: bool = False, **overrides) -> dict:
    raw = dict(text_config(name, tokenizer), dtype="float32", **overrides)
    vis = TINY_VISION if vision else {"num_hidden_layers": 0}
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": raw,
        "vision_config": {"model_type": "deepseek_v41_vision", **vis},
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER),
    }


def _tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Parameters, plus the gate biases NeMo keeps as buffers."""
    bufs = [(n, b) for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias", "bias_vl"))]
    return list(model.named_parameters()) + bufs


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in _tensors(model):
            p = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith(("norm.weight", "q_weight", "k_weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(("base", "sinks_param.weight", "e_score_correction_bias", "bias_vl")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(".fn"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight") or ".engram.embed." in name or "image_" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases of the vision tower
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # projections: ~unit-variance outputs
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5)
        for layer in model.model.layers.values():  # experts are [E, in, out]: rescale by their own fan-in
            ex = layer.ffn.experts
            ex.gate_and_up_projs.mul_(ex.gate_and_up_projs.shape[-1] ** 0.5 * ex.gate_and_up_projs.shape[1] ** -0.5)
            ex.down_projs.mul_(ex.down_projs.shape[-1] ** 0.5 * ex.down_projs.shape[1] ** -0.5)


def _ours_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("embed_tokens."):
        return "embed." + name.removeprefix("embed_tokens.")
    if name.startswith("lm_head."):
        return "head." + name.removeprefix("lm_head.")
    for a, b in ((".attn_hc.", ".hc_attn."), (".ffn_hc.", ".hc_ffn."), (".sinks_param.weight", ".attn_sink")):
        name = name.replace(a, b)
    name = name.replace(".ffn.gate.e_score_correction_bias", ".ffn.gate.bias")
    for a, b in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = name.replace(f".ffn.shared_experts.{a}.weight", f".ffn.shared_{b}.weight")
    return name


def load_from_nemo(ours: DeepseekV41Model, theirs) -> None:
    """Copy every parameter of NeMo's model into ours (names mapped, stacked experts split)."""
    params = dict(ours.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, t in _tensors(theirs):
            t = t.to_local() if hasattr(t, "to_local") else t
            if ".ffn.experts." in name:
                base = _ours_name(name.split(".experts.")[0])
                i = params[f"{base}.w1"].shape[1]
                if name.endswith("gate_and_up_projs"):
                    params[f"{base}.w1"].copy_(t[..., :i].transpose(1, 2))
                    params[f"{base}.w3"].copy_(t[..., i:].transpose(1, 2))
                    seen |= {f"{base}.w1", f"{base}.w3"}
                else:
                    params[f"{base}.w2"].copy_(t.transpose(1, 2))
                    seen.add(f"{base}.w2")
                continue
            key = _ours_name(name)
            if key not in params:
                raise KeyError(f"NeMo parameter {name} ({key}) has no counterpart in our model")
            dst = params[key]
            dst.copy_(t[: dst.shape[0]] if ".engram.embed." in key else t.view(dst.shape))
            seen.add(key)
    missing = {k for k in set(params) - seen if not k.startswith("mtp.")}  # NeMo builds DSpark apart
    if missing:
        raise KeyError(f"our parameters not set from NeMo: {sorted(missing)}")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the DSpark stages: random, not left as uninitialised memory
        for k in sorted(set(params) - seen):
            p = params[k]
            if k.endswith(("norm.weight", ".scale")):
                p.fill_(1.0)
            elif p.dim() == 1 or k.endswith(".fn"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def build_pair(name: str, tokenizer, seed: int = 0, batch_invariant: bool = False, vision: bool = False, **overrides):
    """(NeMo model, our model) with the same random weights, both fp32 on the CPU."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config as NemoConfig
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    raw = composite(name, tokenizer, vision, **overrides)
    ncfg = NemoConfig(
        text_config=raw["text_config"], vision_config=raw["vision_config"], image_token_id=raw["image_token_id"]
    )
    torch.manual_seed(seed)
    theirs = DeepseekV41ForCausalLM(ncfg, backend=nemo_backend(), tokenizer=tokenizer)
    theirs.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    _randomize(theirs, seed)
    theirs.eval()
    cfg = DeepseekV41Config.from_dict(raw)
    ours = DeepseekV41Model(cfg, get_ops("cpu", batch_invariant), compressed_token_map(tokenizer)[0])
    load_from_nemo(ours, theirs)
    return theirs, ours


@torch.no_grad()
def nemo_logits(theirs, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[B, S, V]`` of NeMo's full forward (eager ops; its compiled SwiGLU forced eager)."""
    with torch.compiler.set_stance("force_eager"):
        return theirs(ids).logits.float()
