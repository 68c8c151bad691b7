"""Where a model's files come from: a local directory, ``DEEPINFER_HF_MODEL_DIR``, or the Hugging Face hub.

A local directory may also be a NeMo AutoModel checkpoint as its ``save_pretrained`` leaves it: the servable files
(config.json, tokenizer, consolidated safetensors) are in its ``model/consolidated`` folder, which is used then."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.txt", "*.model"]


class ModelUnavailable(RuntimeError):
    """The model cannot be used here: not downloadable, or an architecture this build does not run."""


def _advice(what: str) -> str:
    return (
        f"{what} Point DEEPINFER_HF_MODEL_DIR at a local copy of a supported checkpoint "
        "(a directory with config.json and *.safetensors), or generate a tiny random DeepSeek-V4.1 "
        "checkpoint with `deepinfer make-tiny-model DIR --arch deepseek_v41` and pass that directory as the model."
    )


def _named(model: str | Path | None, local_dir_env: str | None) -> tuple[str | Path, Path]:
    """The model named (``model``, else ``local_dir_env``, else the default) and its path on this host."""
    if model is None:
        model = local_dir_env or DEFAULT_MODEL
    return model, Path(model).expanduser()


def local_model(model: str | Path | None, local_dir_env: str | None) -> Path | None:
    """The directory ``resolve_model`` takes ``model`` from when it is on this host; None for a repo id (or a path
    that is not a directory). Nothing is downloaded."""
    _, p = _named(model, local_dir_env)
    return consolidated_dir(p) if p.is_dir() else None


def resolve_model(model: str | Path | None, local_dir_env: str | None, cache_dir: Path | None = None) -> Path:
    """A local directory holding the model's files, downloading from the hub when ``model`` is a repo id."""
    model, p = _named(model, local_dir_env)
    if p.is_dir():
        return consolidated_dir(p)
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


def consolidated_dir(path: Path) -> Path:
    """``path``, or its NeMo ``model/consolidated`` folder where ``path`` has no config.json and that folder has."""
    nemo = path / "model" / "consolidated"
    if not (path / "config.json").exists() and (nemo / "config.json").exists():
        return nemo
    return path


def check_architecture(model_dir: Path) -> dict:
    """The parsed config.json; refuses a missing config, a ``model_type`` no model family of this build serves
    (the engine's registry, ``engine.models``), or a config its family does not accept."""
    from deepinfer.engine.models import known_model_types, model_type_of, not_served, parse_config  # (late)

    cfg_file = model_dir / "config.json"
    if not cfg_file.exists():
        raise ModelUnavailable(_advice(f"{model_dir} has no config.json."))
    with open(cfg_file, encoding="utf-8") as f:
        raw = json.load(f)
    mt = model_type_of(raw)
    if mt is None or mt not in known_model_types():
        why = "config.json names no model_type" if mt is None else not_served(mt)
        raise ModelUnavailable(_advice(f"The model in {model_dir} is not one this build runs yet: {why}."))
    try:
        parse_config(raw)  # (the family's config class alone: no model code, no torch)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelUnavailable(_advice(f"The {mt} config in {model_dir} is invalid: {e}")) from e
    return raw
