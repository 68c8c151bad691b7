"""The public reference implementations of the models deepinfer serves, to compare our outputs with (a deployment's
check, the parity tests, a benchmark's peer):

- DeepSeek-V4: transformers' ``DeepseekV4ForCausalLM`` with exactly the weights of one of our models
  (``build_hf_model``; ``hf_config`` and ``hf_state_dict`` translate our config and our parameters);
- DeepSeek-V4.1: NeMo AutoModel 0.7.0's ``deepseek_v41`` (``ensure_nemo`` installs it on first use,
  ``nemo_v41_modules`` imports its config and Engram modules, ``nemo_backend`` is its plain-torch backend).

Neither package is a dependency of deepinfer: each is imported inside the functions that need it (transformers comes
with the ``dev`` extra). NeMo's full dependency set is huge (megatron, TE, DeepEP, datasets ...); its V4.1 model code
needs none of it (the eager CPU backends run without them). pyproject cannot express ``--no-deps``, so ``ensure_nemo``
installs the wheel alone, once, into a directory of its own (``DEEPINFER_CACHE_DIR/nemo`` unless told another) under
a file lock, and appends that directory to ``sys.path``. The few small packages NeMo imports (transformers, pillow,
typer, regex, pyyaml, ...) come from the ``dev`` extra. Installing needs network access once.
"""

from __future__ import annotations

import fcntl
import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.checkpoint.names import internal_to_official, official_to_hf

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

# -- DeepSeek-V4: transformers' DeepseekV4ForCausalLM -------------------------------------------------------------

_KIND = {
    "swa": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}


def hf_config(c: DeepseekV4Config) -> Any:
    """transformers' ``DeepseekV4Config`` of the same model."""
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
    """Our parameters under transformers' names (routed experts stacked as transformers does), fp32."""
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
        out[p + "gate_up_proj"] = torch.cat([layer.ffn.w1, layer.ffn.w3], dim=1).detach().float()
        out[p + "down_proj"] = layer.ffn.w2.detach().float()
    return out


def build_hf_model(model: DeepseekV4Model) -> Any:
    """transformers' ``DeepseekV4ForCausalLM`` (fp32, eval mode) with exactly the weights of ``model``."""
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM(hf_config(model.config)).eval().float()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"HF state dict mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    return hf


# -- DeepSeek-V4.1: NeMo AutoModel, installed on first use (--no-deps, into a directory of its own) ----------------

NEMO_VERSION = "0.7.0"


class NemoUnavailable(RuntimeError):
    """NeMo AutoModel could not be installed or imported."""


def nemo_dir() -> Path:
    """Where ``ensure_nemo`` installs NeMo AutoModel unless told another directory: ``DEEPINFER_CACHE_DIR/nemo``."""
    from deepinfer import envs

    return envs.DEEPINFER_CACHE_DIR / "nemo"


def _try_import(target: Path) -> ModuleType | None:
    if target.is_dir() and str(target) not in sys.path:
        sys.path.append(str(target))  # appended: never shadows the environment's own packages
    importlib.invalidate_caches()
    try:
        return importlib.import_module("nemo_automodel")
    except ImportError:
        return None


def ensure_nemo(target: Path | None = None) -> ModuleType:
    """Import ``nemo_automodel``, installing ``nemo-automodel==0.7.0 --no-deps`` into ``target`` (default
    ``nemo_dir()``) first where it does not import; parallel processes wait on a lock beside ``target`` while one
    installs. Raises ``NemoUnavailable`` with pip's output when the install fails (no network)."""
    target = Path(target) if target is not None else nemo_dir()
    mod = _try_import(target)
    if mod is not None:
        return _checked(mod)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process installs, the others wait
        mod = _try_import(target)
        if mod is None:
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet"]
            cmd += ["--target", str(target), f"nemo-automodel=={NEMO_VERSION}"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise NemoUnavailable(
                    f"installing the NeMo AutoModel reference failed ({' '.join(cmd)}), exit {res.returncode}. "
                    f"It needs network access once; afterwards it lives in {target}.\n{res.stdout}\n{res.stderr}"
                )
            mod = _try_import(target)
            if mod is None:
                raise NemoUnavailable(f"nemo_automodel was installed into {target} but does not import")
    return _checked(mod)


def _checked(mod: ModuleType) -> ModuleType:
    version = getattr(mod, "__version__", None)
    if version is not None and not str(version).startswith(NEMO_VERSION):
        raise NemoUnavailable(f"nemo_automodel {version} is importable, the reference is {NEMO_VERSION}")
    return mod


def nemo_v41_modules(target: Path | None = None) -> tuple[ModuleType, ModuleType]:
    """NeMo's ``deepseek_v41.config`` and ``deepseek_v41.engram`` modules (``ensure_nemo(target)`` first)."""
    ensure_nemo(target)
    try:
        config = importlib.import_module("nemo_automodel.components.models.deepseek_v41.config")
        engram = importlib.import_module("nemo_automodel.components.models.deepseek_v41.engram")
    except ImportError as e:  # a runtime dependency NeMo imports is missing
        raise NemoUnavailable(f"NeMo's deepseek_v41 does not import: {type(e).__name__}: {e}") from e
    return config, engram


def nemo_backend() -> Any:
    """NeMo's plain-torch backend (eager attention, torch experts): the reference as NeMo runs it without extras."""
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


__all__ = [
    "NEMO_VERSION",
    "NemoUnavailable",
    "build_hf_model",
    "ensure_nemo",
    "hf_config",
    "hf_state_dict",
    "nemo_backend",
    "nemo_dir",
    "nemo_v41_modules",
]
