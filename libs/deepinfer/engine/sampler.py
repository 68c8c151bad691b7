"""Token sampler used by the worker runtime (vLLM semantics, ``logprobs_mode=raw_logprobs``).

Contract of ``Sampler()(logits, params, seeds) -> SamplerOutput``:

* ``logits`` is ``[B, V]`` (float32; other float dtypes are upcast), one row per sequence that samples
  this step; ``params[i]`` and ``seeds[i]`` (an int, or ``None`` for an unseeded row) belong to row ``i``.
* ``temperature == 0``: argmax, ties broken towards the lowest token id.
* otherwise, in order: divide by temperature; top-k (keep the k highest, ties towards lower ids, so
  top_k=1 equals greedy); top-p (keep the smallest prefix of the probability-sorted tokens whose
  cumulative probability is >= top_p, computed on the top-k-renormalised distribution, always at least
  one token; a 1e-6 tolerance absorbs float32 rounding at the boundary); min-p (drop tokens whose
  probability is < min_p * max probability); sample from the renormalised remainder.
* The draw is an exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. per token. A seeded row
  draws its own ``V`` exponentials from a generator seeded with its seed (on the logits' device), so it
  gives the same token for the same logits whatever else is in the batch. Rows without a seed share one
  batched draw from the global RNG. Greedy rows draw nothing.
* On CUDA (``Sampler(kernel=None)``, the default) a step with a sampling row runs as two Triton kernels
  (``kernels.sampling``): the same filters and an equivalent race (Gumbel noise from counter-based
  Philox keyed by the seed and the token id; unseeded rows get fresh seeds from torch's CPU generator).
  Its noise is not torch's, so a seeded row's token differs between the two paths, each repeatable.
  An all-greedy step stays on torch ops (the same tokens, fewer launches).
* ``SamplerOutput.logprobs[i]`` is the logprob of the chosen token under ``log_softmax`` of the *raw*
  logits; ``top_logprobs[i]`` is ``None`` unless ``params[i].logprobs > 0``, else the top-k
  ``(token_id, raw_logprob)`` sorted by logprob descending, ties by lower token id.

``compute_logprobs(logits, token_ids, num_top)`` serves prompt logprobs: for row ``i`` a dict
token id -> raw logprob with ``token_ids[i]`` first, then the ``num_top`` most likely tokens.
``constrain`` (optional) sets the logits of the tokens a structured-output grammar refuses to ``-inf`` (in place,
on a copy): every choice above is made among the allowed tokens only, while the reported logprobs stay the raw
model's.

``make_generator(seed)`` builds a seeded row's generator (the torch path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.kernels.sampling_rules import TOP_P_EPS
from deepinfer.runtime.host_copy import tensor, to_device
from deepinfer.runtime.platform import platform_of
from deepinfer.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    """``token_ids`` and ``logprobs`` stay where the logits are; so do the top logprobs (``top``: the rows that asked,
    their counts, values and ids ``[R, k]``) until ``top_logprobs`` (a host read) or ``top_lists`` (from values and
    ids already copied to the host) turns them into lists."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, raw logprob of the chosen token
    top: tuple[list[int], list[int], torch.Tensor, torch.Tensor] | None = None

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]] | None]:
        if self.top is None:
            return [None] * self.token_ids.shape[0]
        return self.top_lists(self.top[2].tolist(), self.top[3].tolist())

    def top_lists(self, values: list[list[float]], ids: list[list[int]]) -> list[list[tuple[int, float]] | None]:
        """Row ``i``'s ``(token_id, raw_logprob)`` pairs (None for a row that asked for none)."""
        out: list[list[tuple[int, float]] | None] = [None] * self.token_ids.shape[0]
        if self.top is not None:
            for j, (i, n) in enumerate(zip(self.top[0], self.top[1])):
                out[i] = [(int(t), float(v)) for t, v in zip(ids[j][:n], values[j][:n])]
        return out


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator seeded with ``seed`` (one per seeded request)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


def _top_sorted(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values/ids per row, by value descending then id ascending (deterministic ties): what a stable sort of
    the whole row, descending, gives first, without sorting the row. Each float32 value becomes an integer of the
    same order (its bits, the negative ones' magnitude bits flipped; -0.0 counted as +0.0, as the sort does) and the
    key ``(that integer, V - 1 - id)`` is unique, so ``topk`` of the keys is exact and needs no host sync. That is
    the host's path (5-8x faster than the sort there); on an accelerator the sort itself is faster at small batches
    (an H100: 0.11 against 0.32 ms for one 129280-token row, even at 64 rows; ``bench/kernels/sampling.py``), so it
    sorts there."""
    v = logprobs.shape[-1]
    k = min(k, v)
    if logprobs.device.type != "cpu":
        ids = torch.sort(logprobs.float() + 0.0, dim=-1, descending=True, stable=True)[1][..., :k]
        return logprobs.gather(-1, ids), ids
    lp = logprobs.float() + 0.0  # (-0.0 + 0.0 is +0.0)
    bits = lp.view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    shift = max(1, (v - 1).bit_length())
    rev = (v - 1) - torch.arange(v, device=lp.device, dtype=torch.int64)
    ids = (v - 1) - (torch.topk((order << shift) | rev, k, dim=-1).values & ((1 << shift) - 1))
    return logprobs.gather(-1, ids), ids


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[dict[int, float]]:
    """Raw logprobs per row: ``{token_ids[i]: lp, top-1 id: lp, ..., top-num_top id: lp}``.

    ``logits`` is ``[N, V]``, ``token_ids`` ``[N]`` (the token actually at each position). The actual
    token comes first (as in vLLM); if it is also among the top ones it appears only once.
    """
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(f"expected logits [N, V] and token_ids [N], got {logits.shape} / {token_ids.shape}")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.long().view(-1, 1)).squeeze(1).tolist()
    ids_l = token_ids.tolist()
    if num_top > 0:
        top_v, top_i = _top_sorted(lp, num_top)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    out: list[dict[int, float]] = []
    for r in range(logits.shape[0]):
        d = {int(ids_l[r]): float(chosen[r])}
        if num_top > 0:
            for t, v in zip(top_i[r], top_v[r]):
                d.setdefault(int(t), float(v))
        out.append(d)
    return out


class Sampler:
    """Stateless; see the module docstring for the exact semantics. ``kernel``: ``None`` uses the Triton kernel for
    CUDA logits with a sampling row and torch ops otherwise; ``True`` / ``False`` force either (the kernel on host
    tensors needs Triton's interpreter). ``invariant`` (the batch-invariant ops): the kernel runs every step (greedy
    ones too) and splits a row the same way in every batch, so its logprob is bit-identical whatever else is sampled
    beside it."""

    def __init__(self, kernel: bool | None = None, invariant: bool = False) -> None:
        self.kernel, self.invariant = kernel, invariant

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int | None],
        constrain: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if len(params) != B or len(seeds) != B:
            raise ValueError(f"need one params and one seed (or None) per row: B={B}, {len(params)}, {len(seeds)}")
        logits = logits.float()
        device = logits.device
        raw = logits
        if constrain is not None:  # a grammar's masks: choose among the allowed tokens, report raw logprobs
            logits = logits.clone()
            constrain(logits)
        triton = platform_of(device).triton  # the sampling kernel is Triton's
        # an all-greedy step stays on torch (the same tokens, fewer host launches), but not in the invariant mode: a
        # greedy row's logprob must not depend on whether a sampling row shares its step
        use_kernel = (
            self.kernel if self.kernel is not None else triton and (self.invariant or not all(p.greedy for p in params))
        )
        if use_kernel:
            token_ids, chosen_lp = self._kernel(logits, raw, params, seeds, self.invariant)
            raw_lp = None
        else:
            raw_lp = torch.log_softmax(raw, dim=-1)
            token_ids = self._torch_tokens(logits, params, seeds)
            chosen_lp = raw_lp.gather(1, token_ids.view(-1, 1)).squeeze(1)

        top = None
        want = [i for i, p in enumerate(params) if p.logprobs]
        if want:
            k = max(params[i].logprobs for i in want)
            widx = tensor(want, device, torch.long)
            rows_lp = raw_lp.index_select(0, widx) if raw_lp is not None else torch.log_softmax(raw[widx], dim=-1)
            vals, ids = _top_sorted(rows_lp, k)
            top = (want, [params[i].logprobs for i in want], vals, ids)
        return SamplerOutput(token_ids=token_ids, logprobs=chosen_lp, top=top)

    @staticmethod
    def _kernel(
        logits: torch.Tensor, raw: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], invariant: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from deepinfer.kernels.sampling import pack_params, sample

        fresh = iter(torch.randint(0, 2**62, (sum(s is None for s in seeds),)).tolist())  # torch's CPU generator
        packed = pack_params(
            [0.0 if p.greedy else float(p.temperature) for p in params],
            [int(p.top_k) for p in params],
            [float(p.top_p) for p in params],
            [float(p.min_p) for p in params],
            [int(s) if s is not None else next(fresh) for s in seeds],
            logits.shape[1],
        )
        return sample(logits.contiguous(), raw.contiguous(), to_device(packed, logits.device), invariant=invariant)

    def _torch_tokens(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]
    ) -> torch.Tensor:
        device = logits.device
        token_ids = torch.argmax(logits, dim=-1)  # greedy rows: first max = lowest id
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = tensor(rows, device, torch.long)
            probs = self._filtered_probs(logits.index_select(0, idx), [params[i] for i in rows])
            gens = [make_generator(seeds[i], device) if seeds[i] is not None else None for i in rows]
            q = self._exponentials(probs.shape, device, gens)
            token_ids[idx] = torch.argmax(probs / q, dim=-1)
        return token_ids

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p applied; returns renormalised probs [R, V]."""
        R, V = logits.shape
        device = logits.device
        temp = tensor([p.temperature for p in params], device, torch.float32)
        # Shift by the row max before scaling: softmax-invariant and avoids inf - inf for tiny T.
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp.view(-1, 1)
        keep = torch.ones_like(scaled, dtype=torch.bool)

        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        top_p = [float(p.top_p) for p in params]
        if any(k < V for k in top_k) or any(tp < 1.0 for tp in top_p):
            s_vals, s_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
            pos = torch.arange(V, device=device).view(1, -1)
            k_t = tensor(top_k, device, torch.long).view(-1, 1)
            s_keep = pos < k_t
            s_probs = torch.softmax(s_vals.masked_fill(~s_keep, float("-inf")), dim=-1)
            excl_cum = torch.cumsum(s_probs, dim=-1) - s_probs  # mass strictly before each token
            p_t = tensor(top_p, device, torch.float32).view(-1, 1)
            s_keep &= (excl_cum < p_t - TOP_P_EPS) | (p_t >= 1.0) | (pos == 0)
            keep = torch.zeros_like(keep).scatter(1, s_ids, s_keep)

        min_p = [float(p.min_p) for p in params]
        if any(mp > 0 for mp in min_p):
            mp_t = tensor(min_p, device, torch.float32).view(-1, 1)
            # prob / max_prob == exp(scaled - 0) since scaled has max 0 (max token is always kept).
            keep &= torch.exp(scaled) >= mp_t

        return torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)

    @staticmethod
    def _exponentials(
        shape: torch.Size, device: torch.device, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Exp(1) noise [R, V]: seeded rows from their own generator, the rest from the global RNG."""
        R, V = shape
        q = torch.empty(shape, device=device, dtype=torch.float32)
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if unseeded:
            if len(unseeded) == R:
                q.exponential_()
            else:
                noise = torch.empty((len(unseeded), V), device=device, dtype=torch.float32).exponential_()
                q[tensor(unseeded, device, torch.long)] = noise
        for j, g in enumerate(generators):
            if g is not None:
                row = torch.empty(V, device=g.device, dtype=torch.float32).exponential_(generator=g)
                q[j] = row.to(device)
        # Exp(1) can return exactly 0; keep p / q finite-or-inf but never 0/0 = nan for masked tokens.
        return q.clamp_min_(torch.finfo(torch.float32).tiny)
