"""The peers the engine benchmarks run beside deepinfer, built from the same weights: transformers'
``DeepseekV4ForCausalLM`` (``build_hf_model``) and NeMo AutoModel's DeepSeek-V4.1 (``ensure_nemo``, ``nemo_backend``).

A copy of what the benchmarks need from ``tests/models/hf_reference.py`` and ``tests/models/nemo_{reference,v41}.py``
(bench does not import from tests/); the tests keep their own.
"""

from __future__ import annotations

import fcntl
import importlib
import subprocess
import sys
from types import ModuleType
from typing import Any

import torch

from bench.harness import ROOT
from deepinfer.checkpoint.names import internal_to_official, official_to_hf
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.model import DeepseekV4Model

# -- transformers' DeepseekV4ForCausalLM ---------------------------------------------------------------------------

_KIND = {
    "swa": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}


def hf_config(c: DeepseekV4Config) -> Any:
    from transformers import DeepseekV4Config as HFConfig

    n = c.num_hidden_layers
    kinds = [c.layer_kind(i) for i in range(n)]
    hca = sorted({c.ratio(i) for i in range(n) if kinds[i] == "hca"}) or [128]
    rope = {"rope_type": "default"}
    if c.yarn is not None:
        rope = {
            "rope_type": "yarn",
            "factor": c.yarn.factor,
            "original_max_position_embeddings": c.yarn.original_max_position_embeddings,
            "beta_fast": c.yarn.beta_fast,
            "beta_slow": c.yarn.beta_slow,
        }
    return HFConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=1,
        head_dim=c.head_dim,
        partial_rotary_factor=c.qk_rope_head_dim / c.head_dim,
        q_lora_rank=c.q_lora_rank,
        o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank,
        n_routed_experts=c.n_routed_experts,
        n_shared_experts=c.n_shared_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        routed_scaling_factor=c.routed_scaling_factor,
        scoring_func="sqrtsoftplus",
        layer_types=[_KIND[k] for k in kinds],
        mlp_layer_types=["hash_moe" if i < c.num_hash_layers else "moe" for i in range(n)],
        compress_rates={"compressed_sparse_attention": c.csa_ratio, "heavily_compressed_attention": hca[0]},
        sliding_window=c.sliding_window,
        index_n_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim,
        index_topk=c.index_topk,
        hc_mult=c.hc_mult,
        hc_sinkhorn_iters=c.hc_sinkhorn_iters,
        hc_eps=c.hc_eps,
        swiglu_limit=c.swiglu_limit,
        rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta,
        rope_parameters=rope,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        num_nextn_predict_layers=c.num_nextn_predict_layers,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=None,
    )


def hf_state_dict(model: DeepseekV4Model) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names (routed experts stacked as transformers does)."""
    out: dict[str, torch.Tensor] = {}
    sd = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, t in sd.items():
        if name.startswith("mtp."):
            continue  # transformers does not build MTP
        if t.dim() == 3 and name.endswith((".w1", ".w2", ".w3")):
            continue
        out[official_to_hf(internal_to_official(name))] = t.detach().float()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.cat([layer.ffn.w1, layer.ffn.w3], dim=1).float()
        out[p + "down_proj"] = layer.ffn.w2.detach().float()
    return out


def build_hf_model(model: DeepseekV4Model) -> Any:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM(hf_config(model.config)).eval().float()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise AssertionError(f"HF state dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    return hf


# -- NeMo AutoModel's DeepSeek-V4.1, installed on first use (--no-deps, into .deepinfer/nemo) ---------------------

NEMO_VERSION = "0.7.0"
TARGET = ROOT / ".deepinfer" / "nemo"


class NemoUnavailable(RuntimeError):
    """NeMo AutoModel could not be installed or imported."""


def _add_target() -> None:
    if TARGET.is_dir() and str(TARGET) not in sys.path:
        sys.path.append(str(TARGET))  # appended: never shadows the venv's own packages


def _try_import() -> ModuleType | None:
    _add_target()
    importlib.invalidate_caches()
    try:
        return importlib.import_module("nemo_automodel")
    except ImportError:
        return None


def ensure_nemo() -> ModuleType:
    """Import ``nemo_automodel`` (installing ``nemo-automodel==0.7.0 --no-deps`` once) and return it."""
    mod = _try_import()
    if mod is not None:
        return _checked(mod)
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    with open(TARGET.parent / "nemo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel processes: one installs, the others wait
        mod = _try_import()
        if mod is None:
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet"]
            cmd += ["--target", str(TARGET), f"nemo-automodel=={NEMO_VERSION}"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise NemoUnavailable(
                    f"installing the NeMo AutoModel peer failed ({' '.join(cmd)}), exit {res.returncode}. "
                    f"It needs network access once; afterwards it lives in {TARGET}.\n{res.stdout}\n{res.stderr}"
                )
            mod = _try_import()
            if mod is None:
                raise NemoUnavailable(f"nemo_automodel was installed into {TARGET} but does not import")
    return _checked(mod)


def _checked(mod: ModuleType) -> ModuleType:
    version = getattr(mod, "__version__", None)
    if version is not None and not str(version).startswith(NEMO_VERSION):
        raise NemoUnavailable(f"nemo_automodel {version} is importable, the peer needs {NEMO_VERSION}")
    return mod


def nemo_backend() -> Any:
    """NeMo's plain-torch backend (eager attention, torch experts): the peer as NeMo runs it without extras."""
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(
        attn="eager",
        linear="torch",
        rms_norm="torch_fp32",
        experts="torch",
        dispatcher="torch",
        enable_hf_state_dict_adapter=False,
        rope_fusion=False,
    )
