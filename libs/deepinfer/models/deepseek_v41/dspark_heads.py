"""DSpark output heads of DeepSeek-V4.1 (docs/deepseek_v41.md ("DSpark")): the Markov head, the confidence head and the
block-drafting loop that combines them with the target's base logits.

The last DSpark stage owns ``markov_head.{embed,head}.weight`` (both ``[V, rank]``) and
``confidence_head.proj.weight`` (``[1, hidden + rank]``, fp32, no bias). Drafting one block of ``B`` tokens::

    U          = head(norm(h))                          # [B, V] fp32 base logits (target head, shared)
    logits_k   = U_k + markov.head(markov.embed[prev])  # prev = anchor for k = 0, then d_{k-1}
    d_k        = argmax(logits_k) | sample(logits_k)
    conf_k     = sigmoid(proj([h_k ; markov.embed[prev_k]]))

``h`` is the pre-norm collapsed residual of the last stage. The released reference feeds it to the confidence head
(``"pre_norm"``); NeMo AutoModel 0.7.0 trains the head on the normed state ``norm(h)`` (``"normed"``), so drafts
trained there must be served with that input. Greedy ties go to the lowest token id (``argmax``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from deepinfer.models.deepseek_v4.layers import Linear, embedding
from deepinfer.ops import Ops

ConfidenceInput = Literal["pre_norm", "normed"]
CONFIDENCE_INPUTS: tuple[str, ...] = ("pre_norm", "normed")

# (Markov-corrected fp32 logits [N, V] of draft position k, k) -> chosen token ids [N]
Sampler = Callable[[torch.Tensor, int], torch.Tensor]


class MarkovHead(nn.Module):
    """Rank-factorised first-order transition bias: ``head(embed[prev])`` (released ``markov_head.*``)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = embedding(vocab_size, rank)
        self.head = Linear(rank, vocab_size)

    def forward(self, prev: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """``prev [...]`` token ids → (fp32 transition logits ``[..., V]``, conditioning embeddings ``[..., rank]``)."""
        e = self.embed(prev)
        return self.head(e, ops).float(), e


class ConfidenceHead(nn.Module):
    """Conditional acceptance logit ``proj([h ; e])`` in fp32 (released ``confidence_head.proj``, no bias)."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = Linear(hidden_size + rank, 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor, ops: Ops) -> torch.Tensor:
        """``h [..., D]``, ``e [..., rank]`` → fp32 logits ``[...]``."""
        if h.shape[:-1] != e.shape[:-1]:
            raise ValueError(f"confidence head: hidden {tuple(h.shape)} and Markov {tuple(e.shape)} rows differ")
        return ops.linear(torch.cat((h.float(), e.float()), dim=-1), self.proj.weight.float()).squeeze(-1)


@dataclass(frozen=True)
class DraftResult:
    """One drafted block per sequence (``N`` sequences, block ``B``, vocabulary ``V``).

    ``tokens [N, B]``: d_0..d_{B-1} for positions p+1..p+B. ``logits [N, B, V]`` fp32: the Markov-corrected logits
    each token was chosen from (the draft distribution before any sampler processing). ``base_logits [N, B, V]``
    fp32: U. ``confidence [N, B]``: sigmoid of ``confidence_logits`` ≈ P(d_k accepted | d_<k accepted).
    ``hidden [N, B, D]``: the last stage's pre-norm collapsed residual h."""

    tokens: torch.Tensor
    logits: torch.Tensor
    base_logits: torch.Tensor
    confidence: torch.Tensor
    confidence_logits: torch.Tensor
    hidden: torch.Tensor


def greedy(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The default sampler: argmax (ties → lowest id)."""
    del k
    return logits.argmax(-1)


def temperature_sampler(temperature: float | torch.Tensor, generator: torch.Generator | None = None) -> Sampler:
    """Sample ``softmax(logits / T)`` (per-row ``T [N]`` allowed); rows with ``T <= 0`` take the argmax."""

    def sample(logits: torch.Tensor, k: int) -> torch.Tensor:
        del k
        t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(logits.shape[0])
        hot = t > 0
        probs = torch.softmax(logits.float() / torch.where(hot, t, 1.0).unsqueeze(-1), dim=-1)
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return torch.where(hot, drawn, logits.argmax(-1))

    return sample


def markov_draft(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    confidence_hidden: torch.Tensor,
    anchors: torch.Tensor,
    markov: MarkovHead,
    confidence: ConfidenceHead,
    ops: Ops,
    sampler: Sampler | None = None,
) -> DraftResult:
    """The drafting loop over one block (module docstring): Markov-corrected choice of each token, then every position's
    confidence.

    ``base_logits [N, B, V]`` fp32, ``hidden [N, B, D]`` (pre-norm h, returned as is), ``confidence_hidden
    [N, B, D]`` (what the confidence head reads: h or norm(h)), ``anchors [N]`` token ids."""
    n, b, _ = base_logits.shape
    if anchors.shape != (n,):
        raise ValueError(f"anchors must have shape [{n}], got {tuple(anchors.shape)}")
    choose = sampler or greedy
    prev, tokens, logits, embeds = anchors, [], [], []
    for k in range(b):
        bias, e = markov(prev, ops)
        lk = base_logits[:, k] + bias
        prev = choose(lk, k).to(anchors.dtype)
        tokens.append(prev)
        logits.append(lk)
        embeds.append(e)
    conf_logits = confidence(confidence_hidden, torch.stack(embeds, dim=1), ops)
    return DraftResult(
        tokens=torch.stack(tokens, dim=1),
        logits=torch.stack(logits, dim=1),
        base_logits=base_logits,
        confidence=ops.pointwise(torch.sigmoid, conf_logits),
        confidence_logits=conf_logits,
        hidden=hidden,
    )
