"""What expert parallelism's exchanges cost against a decode step's own work, per rank (docs/parallelism.md).

Per MoE layer and rank, with ``b`` tokens on the rank, top-``k`` routing over ``E`` experts and ``N`` ranks, and
routing spread evenly over the ranks (each choice leaves the rank with probability ``(N - 1) / N``):

* dispatch: ``b · k · (N-1)/N`` rows of the hidden size in the model dtype (bf16), plus 8 bytes each (slot and
  weight, ``expert_parallel``): what this implementation sends; one copy per choice, no per-rank deduplication;
* combine: the same number of rows back, in fp32 (the sum stays in fp32 until the model dtype);
* four exchanges (counts, rows, slots and weights, outputs), each paying the link's latency once.

The decode step's own time is its weight traffic (``Work``): each rank reads its replicated part (attention, shared
experts, routers, norms, the output head) once, and of its routed experts those that any of the ``N · b`` tokens of
the step picks, ``E_r · (1 - (1 - k/E)^(N·b))`` per layer, at the HBM bandwidth (KV reads and kernel overheads left
out: the step is only longer). The link figures are nominal per-direction rates with an assumed latency per
exchange; they are parameters, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepinfer.parallel.memory_plan import GIB, MemoryPlan, plan

EXCHANGES = 4
META_BYTES = 8  # a dispatched row's slot and weight (fp32 each)


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # GB/s per direction
    latency_us: float  # per exchange


LINKS = (Link("NVLink 4 (H200, 450 GB/s a direction)", 450.0, 10.0),
         Link("InfiniBand 400 Gb/s (50 GB/s)", 50.0, 25.0))  # fmt: skip
HBM_GBPS = 4800.0  # H200


@dataclass(frozen=True)
class StepCost:
    batch: int  # tokens per rank
    ranks: int
    dispatch_bytes: int  # per rank per step (all MoE layers)
    combine_bytes: int
    compute_ms: float  # the step's weight traffic at HBM_GBPS
    link_ms: dict[str, float]  # per link: bytes over bandwidth plus latencies


def step_cost(p: MemoryPlan, hidden: int, k: int, layers: int, batch: int, links: tuple[Link, ...] = LINKS,
              elem: int = 2) -> StepCost:  # fmt: skip
    """The exchanges and the weight traffic of one decode step of ``batch`` tokens per rank (module docstring)."""
    n, e = p.gpus, p.n_experts
    rows = batch * k * (n - 1) / n * layers
    dispatch, combine = int(rows * (hidden * elem + META_BYTES)), int(rows * hidden * 4)
    per_expert = p.weights["routed experts"] / (e * layers)
    touched = p.experts_per_rank * (1 - (1 - k / e) ** (n * batch)) * layers
    replicated = sum(v for key, v in p.rank_gpu.items() if key != "routed experts")
    replicated -= p.weights.get("drafter (MTP / DSpark)", 0) + p.weights.get("vision tower", 0)
    compute_ms = (replicated + touched * per_expert) / (HBM_GBPS * 1e6)
    link_ms = {
        link.name: (dispatch + combine) / (link.gbps * 1e6) + layers * EXCHANGES * link.latency_us / 1e3
        for link in links
    }
    return StepCost(batch, n, dispatch, combine, compute_ms, link_ms)


def table(path: str | Path, ranks: int, batches: tuple[int, ...] = (64, 256)) -> str:
    """The cost of the model at ``path`` (its config.json) on ``ranks`` H200s, as a markdown table."""
    import json

    from deepinfer.engine.models import parse_config

    p = plan(path, ranks, 141 * 10**9)
    c = parse_config(json.loads((Path(path) / "config.json").read_text()))
    c = getattr(c, "text_config", c)
    lines = [
        f"| tokens per rank ({ranks} ranks) | dispatch | combine | weights read (compute) | "
        + " | ".join(f"exchanges over {link.name}" for link in LINKS)
        + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(LINKS),
    ]
    for b in batches:
        s = step_cost(p, c.hidden_size, c.num_experts_per_tok, c.num_hidden_layers, b)
        cells = [f"{b}", f"{s.dispatch_bytes / 2**20:.0f} MiB", f"{s.combine_bytes / 2**20:.0f} MiB",
                 f"{s.compute_ms:.2f} ms"] + [f"{s.link_ms[link.name]:.2f} ms" for link in LINKS]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["GIB", "HBM_GBPS", "LINKS", "Link", "StepCost", "step_cost", "table"]
