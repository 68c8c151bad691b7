"""Where a model's files come from: a local directory, ``DEEPINFER_HF_MODEL_DIR``, or the Hugging Face hub."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.models.deepseek_v4.config import SUPPORTED_MODEL_TYPES
from deepinfer.models.deepseek_v41.config import MODEL_TYPE as V41_MODEL_TYPE
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.txt", "*.model"]
ARCHITECTURES = (V41_MODEL_TYPE, *SUPPORTED_MODEL_TYPES)  # model_type values this build serves


class ModelUnavailable(RuntimeError):
    """The model cannot be used here: not downloadable, or an architecture this build does not run."""


def _advice(what: str) -> str:
    return (
        f"{what} Point DEEPINFER_HF_MODEL_DIR at a local copy of a supported checkpoint "
        "(a directory with config.json and *.safetensors), or generate a tiny random DeepSeek-V4.1 "
        "checkpoint with `deepinfer make-tiny-model DIR --arch deepseek_v41` and pass that directory as the model."
    )


def resolve_model(model: str | Path | None, local_dir_env: str | None, cache_dir: Path | None = None) -> Path:
    """A local directory holding the model's files, downloading from the hub when ``model`` is a repo id."""
    if model is None:
        model = local_dir_env or DEFAULT_MODEL
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if p.exists() or str(model).startswith((".", "/")):
        raise ModelUnavailable(_advice(f"The model path {model} is not a directory."))
    from huggingface_hub import hf_hub_download, snapshot_download

    cache = str(cache_dir) if cache_dir else None
    try:  # config first: refuse an unsupported architecture before downloading its weights
        config = Path(hf_hub_download(repo_id=str(model), filename="config.json", cache_dir=cache))
    except Exception as e:  # offline, DNS failure, gated repo, unknown repo: all end the same way
        raise ModelUnavailable(
            _advice(f"Could not fetch the model {model!r} from the Hugging Face hub ({type(e).__name__}: {e}).")
        ) from e
    check_architecture(config.parent)
    try:
        path = snapshot_download(repo_id=str(model), allow_patterns=_PATTERNS, cache_dir=cache)
    except Exception as e:
        raise ModelUnavailable(
            _advice(f"Could not download the weights of {model!r} from the Hugging Face hub ({type(e).__name__}: {e}).")
        ) from e
    return Path(path)


def check_architecture(model_dir: Path) -> dict:
    """The parsed config.json; refuses a missing config, an architecture this build does not run, or a
    DeepSeek-V4.1 config that does not validate."""
    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ModelUnavailable(_advice(f"{model_dir} has no config.json."))
    with open(cfg_file, encoding="utf-8") as f:
        raw = json.load(f)
    mt = raw.get("model_type") or (raw.get("text_config") or {}).get("model_type")
    if mt == V41_MODEL_TYPE:
        _check_v41(model_dir, raw)
    elif mt not in SUPPORTED_MODEL_TYPES:
        raise ModelUnavailable(
            _advice(
                f"The model in {model_dir} has model_type {mt!r}, which this build does not run yet "
                f"(supported: {', '.join(ARCHITECTURES)})."
            )
        )
    return raw


def _check_v41(model_dir: Path, raw: dict) -> None:
    """A DeepSeek-V4.1 config must parse (composite config, layer typing, Engram sizes)."""
    try:
        DeepseekV41Config.from_dict(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelUnavailable(_advice(f"The DeepSeek-V4.1 config in {model_dir} is invalid: {e}")) from e
