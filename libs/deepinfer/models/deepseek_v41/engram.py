"""Engram n-gram hashing of DeepSeek-V4.1 (docs/deepseek_v41.md ("Engram")), as plain torch functions.

Raw token ids map to *compressed* ids (the tokenizer vocabulary merged under NFKC/lowercase/strip-accents
normalization); for every position the n-grams of sizes 2..max_ngram_size ending there are hashed into
``n_heads`` prime-sized buckets per size and Engram layer (row ids of that layer's table).

Per-sequence state is only the last ``max_ngram_size - 1`` raw token ids, ``-1`` marking "blocked" (before the
sequence start, an image or padding token): hashing a chunk after that history equals hashing the whole stream.
Blocking is cumulative: once a shift reaches a blocked token, it and all larger shifts use the pad id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from deepinfer.models.deepseek_v41.config import DeepseekV41TextConfig
from deepinfer.ops import Ops

BLOCKED = -1


def compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """(compressed id per token id, compressed vocabulary size) for a fast tokenizer.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or anything with a ``backend_tokenizer`` (transformers' fast
    tokenizers). Each id is decoded alone; text with U+FFFD falls back to the raw token string; otherwise the
    key is NFKC → NFD → strip accents → lowercase → whitespace runs to " " → strip (a lone " " is kept), or the
    decoded text if that is empty. Equal keys share an id, numbered in first-seen order.
    """
    from tokenizers import Regex, normalizers

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    sentinel = "\ue000"
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    key_to_id: dict[str, int] = {}
    token_map = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        token_map.append(key_to_id.setdefault(key, len(key_to_id)))
    return token_map, len(key_to_id)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def next_prime(start: int, seen: set[int]) -> int:
    """The first prime > ``start`` not in ``seen``."""
    n = start + 1
    while not _is_prime(n) or n in seen:
        n += 1
    return n


def bucket_primes(layer_ids: Sequence[int], vocab_size: int, n_heads: int, max_ngram_size: int) -> list[list[int]]:
    """Per Engram layer, the ``(max_ngram_size - 1) * n_heads`` bucket primes (n-gram size major, head minor).

    Each n-gram size restarts the search at ``vocab_size - 1``; a prime is never reused, across heads, sizes and
    layers (layers in config order). The released table sizes are the sums of each layer's primes.
    """
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        primes = []
        for _ in range(max_ngram_size - 1):
            p = vocab_size - 1
            for _ in range(n_heads):
                p = next_prime(p, seen)
                seen.add(p)
                primes.append(p)
        out.append(primes)
    return out


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> list[int]:
    """Odd int64 multipliers of one layer: ``2 * default_rng(10007 * layer).integers(0, bound, size) + 1``."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    values = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in values]


class EngramHasher:
    """Row ids of all Engram layers for token streams; holds only derived constant tables.

    ``hash(ids)`` returns ``[..., seq, n_layers, (max_ngram_size - 1) * n_heads]`` int64 row ids (n-gram size
    major, head minor, offsets added: rows of the layer's own table).
    """

    def __init__(self, config: DeepseekV41TextConfig, token_map: Sequence[int]) -> None:
        c = config
        if not c.engram_layer_ids:
            raise ValueError("text_config.engram_layer_ids is empty: the model has no Engram layers")
        self.vocab_size = len(token_map)
        compressed = max(token_map) + 1 if token_map else 0
        if compressed != c.engram_compressed_vocab_size:
            raise ValueError(
                f"text_config.engram_compressed_vocab_size={c.engram_compressed_vocab_size} does not match the "
                f"tokenizer's compressed vocabulary ({compressed}); the hash multipliers depend on it"
            )
        if not 0 <= c.engram_pad_token_id < self.vocab_size:
            raise ValueError(f"text_config.engram_pad_token_id={c.engram_pad_token_id} is outside the tokenizer")
        self.layer_ids = tuple(c.engram_layer_ids)
        self.max_ngram_size = c.engram_max_ngram_size
        self.n_heads = c.engram_n_heads
        primes = bucket_primes(self.layer_ids, c.engram_vocab_size, self.n_heads, self.max_ngram_size)
        for layer, ps, rows in zip(self.layer_ids, primes, c.engram_num_embeddings):
            if sum(ps) > rows:
                raise ValueError(
                    f"text_config.engram_num_embeddings: layer {layer} needs {sum(ps)} rows, the config gives {rows}"
                )
        self.token_map = torch.tensor(list(token_map), dtype=torch.long)
        self.pad_id = int(token_map[c.engram_pad_token_id])
        self.primes = torch.tensor(primes, dtype=torch.long)  # [L, (N-1)*H]
        self.offsets = torch.tensor([np.cumsum([0, *ps[:-1]]).tolist() for ps in primes], dtype=torch.long)
        mults = [hash_multipliers(li, compressed, self.max_ngram_size) for li in self.layer_ids]
        self.multipliers = torch.tensor(mults, dtype=torch.long)  # [L, N]
        self._np: tuple[np.ndarray, ...] | None = None  # the tables above in numpy (``step``)

    @property
    def history_len(self) -> int:
        return self.max_ngram_size - 1

    def empty_history(self, *batch: int) -> torch.Tensor:
        """The state of a sequence before its first token: all shifts blocked."""
        return torch.full((*batch, self.history_len), BLOCKED, dtype=torch.long)

    def hash(
        self, input_ids: torch.Tensor, token_mask: torch.Tensor | None = None, history: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Row ids for ``input_ids [..., seq]`` continuing ``history [..., max_ngram_size - 1]`` (default empty).

        ``token_mask`` (bool, like ``input_ids``) is False at image/padding tokens: they and every n-gram reaching
        back through them hash with the pad id (their residual gate is the caller's to zero).
        """
        ids = input_ids.long()
        if ids.numel() and bool(((ids < 0) | (ids >= self.vocab_size)).any()):
            raise ValueError(f"Engram input ids must lie in [0, {self.vocab_size})")
        if history is None:
            history = self.empty_history(*ids.shape[:-1])
        if history.shape != (*ids.shape[:-1], self.history_len):
            raise ValueError(f"Engram history must have shape {(*ids.shape[:-1], self.history_len)}")
        cur = self.compress(ids, token_mask)
        past = self.compress(history.long(), history >= 0)
        ext = torch.cat((past.to(cur.device), cur), dim=-1)  # [..., H + S]
        s, h = ids.shape[-1], self.history_len
        blocked = torch.zeros_like(cur, dtype=torch.bool)
        mults = self.multipliers.to(cur.device)
        rolling = None
        out = []
        for shift in range(self.max_ngram_size):
            src = ext[..., h - shift : h - shift + s]
            blocked = blocked | (src == BLOCKED)
            tok = torch.where(blocked, self.pad_id, src)
            prod = tok.unsqueeze(-1) * mults[:, shift]  # [..., S, L]
            if rolling is None:
                rolling = prod
                continue
            rolling = torch.bitwise_xor(rolling, prod)
            heads = self.primes[:, (shift - 1) * self.n_heads : shift * self.n_heads].to(cur.device)
            out.append(rolling.unsqueeze(-1) % heads)
        return torch.cat(out, dim=-1) + self.offsets.to(cur.device)

    def step(
        self, ids: np.ndarray, history: np.ndarray, token_mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One new token per sequence, on the host in numpy (a decode step's hashing, a few microseconds instead of
        ``hash``'s torch calls): ``ids [B]`` continuing ``history [B, max_ngram_size - 1]`` → (row ids
        ``[B, n_layers, (max_ngram_size - 1) * n_heads]``, the next histories ``[B, max_ngram_size - 1]``). The same
        integer arithmetic as ``hash`` / ``next_history`` (int64 products wrap alike, ``%`` rounds toward -inf
        alike), so the same rows bit for bit."""
        if self._np is None:
            self._np = tuple(t.numpy() for t in (self.token_map, self.multipliers, self.primes, self.offsets))
        token_map, mults, primes, offsets = self._np
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        history = np.asarray(history, dtype=np.int64).reshape(ids.shape[0], self.history_len)
        if ids.size and ((ids < 0) | (ids >= self.vocab_size)).any():
            raise ValueError(f"Engram input ids must lie in [0, {self.vocab_size})")
        cur = token_map[ids]
        raw = ids if token_mask is None else np.where(token_mask, ids, BLOCKED)
        if token_mask is not None:
            cur = np.where(token_mask, cur, BLOCKED)
        past = np.where(history >= 0, token_map[np.maximum(history, 0)], BLOCKED)
        ext = np.concatenate([past, cur[:, None]], axis=1)  # [B, h + 1]
        h = self.history_len
        blocked = np.zeros(ids.shape[0], dtype=bool)
        rolling, out = None, []
        for shift in range(self.max_ngram_size):
            src = ext[:, h - shift]
            blocked = blocked | (src == BLOCKED)
            prod = np.where(blocked, self.pad_id, src)[:, None] * mults[:, shift]  # [B, L]
            if rolling is None:
                rolling = prod
                continue
            rolling = rolling ^ prod
            out.append(rolling[:, :, None] % primes[:, (shift - 1) * self.n_heads : shift * self.n_heads])
        rows = np.concatenate(out, axis=-1) + offsets
        return rows, np.concatenate([history, raw[:, None]], axis=1)[:, 1:]

    def compress(self, ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids, ``BLOCKED`` where ``token_mask`` is False."""
        safe = ids.clamp_min(0)
        cid = self.token_map.to(ids.device)[safe]
        if token_mask is not None:
            if token_mask.shape != ids.shape or token_mask.dtype != torch.bool:
                raise ValueError("Engram token_mask must be bool with the shape of the token ids")
            cid = torch.where(token_mask, cid, BLOCKED)
        return cid

    def next_history(
        self, history: torch.Tensor, input_ids: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The state after ``input_ids``: the last ``max_ngram_size - 1`` raw ids, ``-1`` where masked."""
        ids = input_ids.long()
        if token_mask is not None:
            ids = torch.where(token_mask, ids, BLOCKED)
        return torch.cat((history.long(), ids), dim=-1)[..., -self.history_len :]


def engram_update(
    streams: torch.Tensor,
    embeddings: torch.Tensor,
    wkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    ops: Ops | None = None,
) -> torch.Tensor:
    """The gated Engram update of all mHC streams (fp32 math, one cast back at the end).

    ``streams [..., hc, hidden]``; ``embeddings [..., n_hashes, head_dim]`` are the looked-up table rows (the
    lookup itself is the caller's: tables may live anywhere); ``wkv [(hc + 1) * hidden, n_hashes * head_dim]``
    (keys first); ``q_weight``/``k_weight [hc, hidden]``. ``token_mask`` False (image/padding) keeps a token's
    streams unchanged. With ``ops`` the projection and the transcendental functions go through it (the
    batch-invariant op set keeps a row's result independent of its batch-mates); the reductions are per row.
    """
    hc, hidden = streams.shape[-2:]
    e = embeddings.flatten(-2).to(streams.dtype)
    w = wkv.to(streams.dtype)
    kv = ops.linear(e, w) if ops is not None else torch.nn.functional.linear(e, w)
    key, value = kv.split((hc * hidden, hidden), dim=-1)
    key = key.float().unflatten(-1, (hc, hidden))
    x = streams.float()
    weights = q_weight.float() * k_weight.float()
    rsqrt = torch.rsqrt if ops is None else (lambda t: ops.pointwise(torch.rsqrt, t))
    sigmoid = torch.sigmoid if ops is None else (lambda t: ops.pointwise(torch.sigmoid, t))
    rstd = rsqrt(x.square().mean(-1) + eps) * rsqrt(key.square().mean(-1) + eps)
    dot = (x * weights * key).sum(-1) * rstd * hidden**-0.5
    gate = sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
    return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
