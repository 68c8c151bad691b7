"""What a benchmark sends: sessions of turns, with prompt and output lengths drawn from a distribution.

* ``fixed``: every prompt ``input_len`` tokens, every output ``output_len``;
* ``uniform``: each length uniform in ``[len·(1 − range_ratio), len·(1 + range_ratio)]``;
* ``sharegpt``: a synthetic stand-in for ShareGPT conversations (no dataset download): log-normal lengths, whose
  long right tail is what real chat traffic has, with σ 1.0 for prompts and 0.8 for outputs, scaled so their mean is
  ``input_len`` / ``output_len``, clipped to [4, 8 × the mean].

A single-turn request is a session of one turn. Prompts are token ids drawn uniformly from ``token_range`` (exact
lengths: the completions and gRPC token-id APIs take them as they are) or, for chat, text of about as many words
(chat prompts are measured by the server's usage instead). Multi-turn sessions (``turns`` > 1) are chat only: turn
``k`` sends the conversation so far (each earlier user message and the answer it got) plus a new user message.
``system_len`` > 0 (chat): every session starts with the same system message of that many words, the prefix that
users of one deployment share.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

DISTRIBUTIONS = ("fixed", "uniform", "sharegpt")
_SIGMA = {"input": 1.0, "output": 0.8}
_WORDS = (
    "the of and to in is that it for on with as was at by an be this from or have not are but had they which one "
    "you were all we when there can more if will each about how up out them then she many some so these would "
    "other into has her two like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most know get through back"
).split()


@dataclass
class Turn:
    input_len: int  # tokens (token-id prompts) or words (chat text)
    output_len: int
    prompt_ids: list[int] = field(default_factory=list)  # token-id prompts
    text: str = ""  # chat prompts


@dataclass
class Session:
    index: int
    turns: list[Turn]
    system: str = ""  # the system message every turn sends first (chat; empty: none)


def lengths(kind: str, n: int, mean: int, range_ratio: float, rng: random.Random, which: str = "input") -> list[int]:
    """``n`` lengths of the distribution ``kind`` around ``mean`` (module docstring)."""
    if mean < 1:
        raise ValueError(f"a {which} length must be at least 1, got {mean}")
    if kind == "fixed":
        return [mean] * n
    if kind == "uniform":
        if not 0 <= range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
        lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
        return [rng.randint(lo, hi) for _ in range(n)]
    if kind == "sharegpt":
        sigma = _SIGMA[which]
        mu = math.log(mean) - sigma * sigma / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
        return [min(8 * mean, max(4, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
    raise ValueError(f"unknown length distribution {kind!r}; expected one of {', '.join(DISTRIBUTIONS)}")


def build(
    num_sessions: int,
    input_len: int,
    output_len: int,
    distribution: str = "fixed",
    range_ratio: float = 0.0,
    turns: int = 1,
    chat: bool = False,
    token_range: tuple[int, int] = (1000, 30000),
    seed: int = 0,
    system_len: int = 0,
) -> list[Session]:
    """The sessions of a run, the same for the same arguments."""
    if num_sessions < 1 or turns < 1:
        raise ValueError("num_prompts and turns must be at least 1")
    if system_len and not chat:
        raise ValueError("system_len: a shared system prompt needs a chat backend (openai-chat or grpc-chat)")
    if turns > 1 and not chat:
        raise ValueError("multi-turn sessions need a chat backend (openai-chat or grpc-chat)")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"token_range must be two ids lo < hi, got {token_range}")
    rng = random.Random(seed)
    n = num_sessions * turns
    ins = lengths(distribution, n, input_len, range_ratio, rng, "input")
    outs = lengths(distribution, n, output_len, range_ratio, rng, "output")
    sessions = []
    for s in range(num_sessions):
        ts = []
        for k in range(turns):
            i, o = ins[s * turns + k], outs[s * turns + k]
            if chat:
                ts.append(Turn(i, o, text=" ".join(rng.choice(_WORDS) for _ in range(i))))
            else:
                ts.append(Turn(i, o, prompt_ids=[rng.randrange(lo, hi) for _ in range(i)]))
        sessions.append(Session(s, ts))
    if system_len > 0:
        shared = random.Random(seed + 2)
        system = " ".join(shared.choice(_WORDS) for _ in range(system_len))
        for s in sessions:
            s.system = system
    return sessions


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds between the starts of ``n`` sessions: none at an infinite rate, else gamma-distributed with mean
    ``1 / rate`` and shape ``burstiness`` (1: a Poisson process; below 1 burstier, above 1 more regular)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


__all__ = ["DISTRIBUTIONS", "Session", "Turn", "arrival_gaps", "build", "lengths"]
