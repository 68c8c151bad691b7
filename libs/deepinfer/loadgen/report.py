"""What a run leaves: a JSON result (the settings, the summary under ``vllm bench serve``'s names, optionally every
request), a table on the terminal, and an SVG plot of the latency distributions (TTFT, TPOT, ITL, E2EL as
cumulative distributions; written without a plotting library)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from deepinfer.loadgen.outcome import Outcome


def result(settings: dict[str, Any], summary: dict[str, Any], outcomes: Sequence[Outcome], detailed: bool) -> dict:
    out = {**settings, **summary}
    if detailed:
        out["requests"] = [
            {
                "session": o.session,
                "turn": o.turn,
                "ok": o.ok,
                "error": o.error,
                "prompt_tokens": o.prompt_tokens,
                "output_tokens": o.output_tokens,
                "ttft_ms": o.ttft * 1e3,
                "e2el_ms": o.latency * 1e3,
                "itl_ms": [g * 1e3 for g in o.itl],
            }  # fmt: skip
            for o in outcomes
        ]
    return out


def table(summary: dict[str, Any]) -> str:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"])]
    rows += [("Benchmark duration (s)", f"{summary['duration']:.2f}")]
    rows += [
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total generated tokens", summary["total_output_tokens"]),
        ("Prompt tokens served cached", f"{summary['total_cached_tokens']} ({summary['cache_hit_rate']:.1%})"),
    ]
    rows += [("Request throughput (req/s)", f"{summary['request_throughput']:.2f}")]
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}")]
    rows += [("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")]
    for name in ("ttft", "tpot", "itl", "e2el"):
        keys = [k for k in summary if k.endswith(f"_{name}_ms") and not k.startswith("std")]
        rows += [(f"{k.split('_')[0].capitalize()} {name.upper()} (ms)", f"{summary[k]:.2f}") for k in keys]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def plot(outcomes: Sequence[Outcome], path: Path, title: str) -> None:
    """Four panels, each the cumulative distribution of one latency in ms."""
    done = [o for o in outcomes if o.ok]
    series = {
        "TTFT": [o.ttft * 1e3 for o in done],
        "TPOT": [t * 1e3 for o in done if (t := o.tpot) is not None],
        "ITL": [g * 1e3 for o in done for g in o.itl],
        "E2EL": [o.latency * 1e3 for o in done],
    }
    w, h, pad = 300, 220, 40
    parts = [f'<text x="10" y="20" font-size="14">{escape(title)}</text>']
    for i, (name, values) in enumerate(series.items()):
        x0, y0 = 10 + (i % 2) * (w + 20), 40 + (i // 2) * (h + 30)
        parts.append(_panel(name, sorted(values), x0, y0, w, h, pad))
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w + 40}" height="{2 * h + 100}" '
        f'font-family="sans-serif">{"".join(parts)}</svg>\n'
    )
    path.write_text(svg)


def _panel(name: str, values: list[float], x0: int, y0: int, w: int, h: int, pad: int) -> str:
    out = [f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    out.append(f'<text x="{x0 + 5}" y="{y0 + 15}" font-size="12">{name} (ms), cumulative fraction</text>')
    if not values:
        out.append(f'<text x="{x0 + w / 3}" y="{y0 + h / 2}" font-size="12">no data</text>')
        return "".join(out)
    lo, hi = values[0], max(values[-1], values[0] + 1e-9)
    pw, ph = w - 2 * pad, h - 2 * pad
    pts = " ".join(
        f"{x0 + pad + (v - lo) / (hi - lo) * pw:.1f},{y0 + h - pad - (j + 1) / len(values) * ph:.1f}"
        for j, v in enumerate(values)
    )
    out.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>')
    out.append(f'<text x="{x0 + pad}" y="{y0 + h - 8}" font-size="10">{lo:.2f}</text>')
    out.append(f'<text x="{x0 + w - pad - 30}" y="{y0 + h - 8}" font-size="10">{hi:.2f}</text>')
    return "".join(out)


def write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


__all__ = ["plot", "result", "table", "write_json"]
