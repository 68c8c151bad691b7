"""The summary of a run, under the metric names of ``vllm bench serve`` (``mean_ttft_ms``, ``p99_itl_ms``,
``request_goodput``, ``output_throughput``, ...), so results compare with its directly.

TTFT: sending to the first generated text. TPOT: (end-to-end − TTFT) / (output tokens − 1), per request, for
requests of two tokens or more. ITL: every gap between successive pieces of text, pooled over requests (a piece may
hold several tokens: the server sends what it has). E2EL: sending to the last byte. Goodput: requests per second that
met every given SLO (``ttft``, ``tpot``, ``e2el`` in ms; a request meets one when its value is at most the bound).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from deepinfer.loadgen.outcome import Outcome

SLO_METRICS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def parse_slos(text: str | None) -> dict[str, float]:
    """``"ttft:200 tpot:50"`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (ms); ValueError naming a bad entry."""
    slos: dict[str, float] = {}
    for item in (text or "").split():
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput: unknown metric {name!r} in {item!r}; expected {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r} is not metric:milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"goodput: {item!r} must be a positive number of milliseconds")
    return slos


def _good(o: Outcome, slos: dict[str, float]) -> bool:
    values = {"ttft": o.ttft * 1e3, "tpot": (o.tpot or 0.0) * 1e3, "e2el": o.latency * 1e3}
    return all(values[k] <= bound for k, bound in slos.items())


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def summarize(
    outcomes: Sequence[Outcome],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    inp = sum(o.prompt_tokens for o in done)
    outp = sum(o.output_tokens for o in done)
    dur = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": inp,
        "total_output_tokens": outp,
        "total_cached_tokens": sum(o.cached_tokens for o in done),
        "cache_hit_rate": sum(o.cached_tokens for o in done) / inp if inp else 0.0,  # prompt tokens served cached
        "cached_tokens_by_tier": {
            t: sum(o.cached_by_tier.get(t, 0) for o in done)
            for t in sorted({t for o in done for t in o.cached_by_tier})
        },  # fmt: skip
        "request_throughput": len(done) / dur,
        "output_throughput": outp / dur,
        "total_token_throughput": (inp + outp) / dur,
    }
    if slos:
        summary["request_goodput"] = sum(_good(o, slos) for o in done) / dur
    summary |= _stats("ttft", [o.ttft for o in done], percentiles)
    summary |= _stats("tpot", [t for o in done if (t := o.tpot) is not None], percentiles)
    summary |= _stats("itl", [gap for o in done for gap in o.itl], percentiles)
    summary |= _stats("e2el", [o.latency for o in done], percentiles)
    summary["errors"] = sorted({o.error for o in outcomes if not o.ok})[:10]
    return summary


__all__ = ["SLO_METRICS", "parse_slos", "percentile", "summarize"]
