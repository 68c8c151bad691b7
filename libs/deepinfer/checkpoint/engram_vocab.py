"""The Engram token map of a DeepSeek-V4.1 tokenizer (its compressed vocabulary), cached.

:func:`~deepinfer.models.deepseek_v41.engram.compressed_token_map` decodes every id of the tokenizer alone (~1 s
on the 129,280-id DeepSeek tokenizer). The result depends only on ``tokenizer.json``, so it is kept in-process and
on disk, ``$DEEPINFER_CACHE_DIR/engram/<sha256 of tokenizer.json>.npy`` (int32, one compressed id per token id);
a read-only cache directory only costs the recomputation.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from deepinfer.models.deepseek_v41.engram import compressed_token_map


def engram_token_map(tokenizer_json: str) -> tuple[list[int], int]:
    """(compressed id per token id, compressed vocabulary size) of the tokenizer whose ``tokenizer.json`` text is
    ``tokenizer_json``."""
    token_map = _cached(hashlib.sha256(tokenizer_json.encode()).hexdigest(), tokenizer_json)
    return list(token_map), (max(token_map) + 1 if token_map else 0)


def engram_token_map_of(model_dir: str | Path) -> tuple[list[int], int]:
    """:func:`engram_token_map` of the ``tokenizer.json`` in a checkpoint directory."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise ValueError(
            f"{model_dir} has no tokenizer.json: DeepSeek-V4.1's Engram layers hash the tokenizer's compressed "
            "vocabulary, so the checkpoint must ship its tokenizer"
        )
    return engram_token_map(path.read_text(encoding="utf-8"))


@lru_cache(maxsize=4)
def _cached(key: str, tokenizer_json: str) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    from deepinfer import envs

    cache = Path(envs.DEEPINFER_CACHE_DIR).expanduser() / "engram" / f"{key}.npy"
    try:
        arr = np.load(cache, allow_pickle=False)
        if arr.ndim == 1 and arr.dtype == np.int32:
            return tuple(arr.tolist())
    except (OSError, ValueError):
        pass
    token_map, size = compressed_token_map(Tokenizer.from_str(tokenizer_json))
    assert not token_map or max(token_map) + 1 == size  # ids are numbered in first-seen order
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, np.asarray(token_map, dtype=np.int32), allow_pickle=False)
        tmp.replace(cache)
    except OSError:
        pass
    return tuple(token_map)
