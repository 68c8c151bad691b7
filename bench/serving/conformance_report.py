"""The figures of ``schema_conformance.py``: per set and engine, coverage, compliance, silent violations and compile
time, as a dictionary and as markdown tables, with the published JSONSchemaBench figures beside them."""

from __future__ import annotations

import argparse
import re
from typing import Any

from bench.harness import pct

# a refusal naming the keyword: ours points at it (``json_schema: /properties/x/uniqueItems: ...``), llguidance
# lists it (``Unimplemented keys: ["uniqueItems"]``)
_NAMED = re.compile(r"json_schema: (/\S*)?/[^/\s]+: |Unimplemented keys?: ")
_AUTO = (
    ", **auto** (ours with the backend chosen per schema: llguidance on the raw schema where the pass or "
    "xgrammar refuses it or xgrammar runs past 3/4 of the compile timeout)"
)
PUBLISHED = {
    "paper": {
        "source": "Geng et al., 'Generating Structured Outputs from Language Models: Benchmark and Studies' "
        "(arXiv:2501.10868), empirical coverage table, as quoted by a review of the paper; the full per-set table "
        "was not retrievable from this machine",
        "Github_hard": {"Guidance": 0.41, "Llamacpp": 0.39, "XGrammar": 0.28, "Outlines": 0.03},
        "Glaiveai2K": "above 0.86 for every framework",
        "models": "an LLM generating (Llama-3.1-8B-class), not a random walk; whole sets, not a sample",
    },
    "maskbench": {
        "source": "github.com/guidance-ai/jsonschemabench, maskbench/README.md (generated table): 11 306 schemas "
        "(all sets), each with valid and invalid instances; llguidance 0.7.10, XGrammar 0.1.17 (default), "
        "Outlines-core 0.2.3",
        "passing": {"LLGuidance": 8909, "XGrammar": 8122, "Outlines": 7050},
        "compile_error": {"LLGuidance": 2377, "XGrammar": 90, "Outlines": 1773},
        "accepted_an_invalid_instance": {"LLGuidance": 0, "XGrammar": 1368, "Outlines": 822},
        "schemas": 11306,
    },
}


def category(got: dict) -> str:
    """compiled, refused_named, refused_other, timeout or crash."""
    status = got["status"]
    if status != "refused":
        return status
    return "refused_named" if _NAMED.search(got["message"]) and not got["message"].startswith("limit") else (
        "refused_other")  # fmt: skip


def _engine_summary(results: list[dict], engine: str) -> dict[str, Any]:
    s: dict[str, Any] = {k: 0 for k in ("n", "compiled", "refused_named", "refused_other", "timeout", "crash",
                                        "compliant", "finished", "valid", "violations", "unjudged", "unfinished",
                                        "rejected", "schemas_with_violation", "walk_timeouts")}  # fmt: skip
    compile_ms, first_ms = [], []
    for r in results:
        got = r[engine]
        s["n"] += 1
        s[category(got)] += 1
        if got["status"] != "compiled":
            continue
        compile_ms.append(got["compile_ms"])
        if got.get("first_mask_ms") is not None:
            first_ms.append(got["first_mask_ms"])
        s["walk_timeouts"] += bool(got.get("walk_timeout"))
        walks = got["walks"]
        verdicts = [w["verdict"] or "" for w in walks]
        s["finished"] += sum(w["ended"] == "eos" for w in walks)
        s["unfinished"] += sum(w["ended"] in ("length", "stuck") for w in walks)
        s["rejected"] += sum(w["ended"] == "rejected" for w in walks)
        s["valid"] += verdicts.count("valid")
        s["unjudged"] += sum(v.startswith("unjudged") for v in verdicts)
        bad = sum(v.startswith("invalid") for v in verdicts)
        s["violations"] += bad
        s["schemas_with_violation"] += bad > 0
        s["compliant"] += bool(walks) and all(v == "valid" for v in verdicts)
    s["compile_ms"] = {"p50": pct(compile_ms, 0.5), "p99": pct(compile_ms, 0.99)} if compile_ms else None
    s["first_mask_ms"] = {"p50": pct(first_ms, 0.5), "p99": pct(first_ms, 0.99)} if first_ms else None
    return s


def compact_walks(walks: list[dict]) -> dict[str, Any]:
    """One schema's walks for the results file: how they ended, their verdicts, and each violation's text."""
    ended: dict[str, int] = {}
    for w in walks:
        ended[w["ended"]] = ended.get(w["ended"], 0) + 1
    verdicts = [w["verdict"] or "" for w in walks]
    return {"ended": ended, "valid": verdicts.count("valid"),
            "unjudged": [v for v in verdicts if v.startswith("unjudged")],
            "violations": [w for w in walks if (w["verdict"] or "").startswith("invalid")]}  # fmt: skip


def summarize(results: list[dict], engines: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``{set or "all": {engine: figures}}``."""
    sets = list(dict.fromkeys(r["set"] for r in results))
    groups = {name: [r for r in results if r["set"] == name] for name in sets} | {"all": results}
    return {name: {e: _engine_summary(rs, e) for e in engines} for name, rs in groups.items()}


def _ms(x: dict | None) -> str:
    return "–" if x is None else f"{x['p50']:.1f} / {x['p99']:.0f}"


def table(summary: dict, engines: tuple[str, ...], args: argparse.Namespace, n: int) -> list[str]:
    head = "| set | n | " + " | ".join(engines) + " |"
    rule = "|---|---:|" + "---:|" * len(engines)
    cov, comp, times = [head, rule], [head, rule], [head, rule]
    for name, by_engine in summary.items():
        label = f"**{name}**" if name == "all" else name
        k = by_engine[engines[0]]["n"]
        cov.append(f"| {label} | {k} | " + " | ".join(
            f"{s['compiled']} / {s['refused_named']} / {s['refused_other']} / {s['timeout'] + s['crash']}"
            for s in by_engine.values()) + " |")  # fmt: skip
        comp.append(f"| {label} | {k} | " + " | ".join(
            f"{s['compliant']} ({100 * s['compliant'] / max(1, s['n']):.0f}%) · {s['valid']}/{s['finished']} · "
            f"**{s['violations']}** ({s['schemas_with_violation']})" for s in by_engine.values()) + " |")  # fmt: skip
        times.append(f"| {label} | {k} | " + " | ".join(
            f"{_ms(s['compile_ms'])} ({_ms(s['first_mask_ms'])})" for s in by_engine.values()) + " |")  # fmt: skip
    paper, mask = PUBLISHED["paper"], PUBLISHED["maskbench"]
    hard = ", ".join(f"{k} {100 * v:.0f}%" for k, v in paper["Github_hard"].items())
    passing = ", ".join(f"{k} {v}" for k, v in mask["passing"].items())
    wrong = ", ".join(f"{k} {v}" for k, v in mask["accepted_an_invalid_instance"].items())
    return [
        f"# Conformance on real schemas (JSONSchemaBench sample, {n} schemas), DeepSeek-V4 tokenizer", "",
        f"Engines in the same run: **ours** (limits + schema pass + xgrammar), **xgrammar** on the raw schema "
        f"(same options, no pass){', **llguidance** on the raw schema' if 'llguidance' in engines else ''}"
        f"{_AUTO if 'auto' in engines else ''}; "
        f"compact JSON; {args.walks} walks per schema and engine ({args.max_tokens}-token budget, closing from "
        f"half); compile timeout {args.compile_timeout:.0f} s; {args.workers} worker processes.", "",
        "Coverage: compiled / refused naming the keyword / refused otherwise (limit, unsatisfiable, compile "
        "error) / timed out or crashed.", "", *cov, "",
        "Compliance: schemas with every output finished and valid (share of the set) · valid / finished outputs · "
        "**silent violations**: finished outputs `jsonschema` rejects (schemas).", "", *comp, "",
        "Compile ms p50 / p99 over the compiled schemas (first mask: matcher built + first fill, p50 / p99).", "",
        *times, "",
        "Published figures (other models, versions and sets; for orientation, not measured here):", "",
        f"- JSONSchemaBench paper ({paper['source']}): empirical coverage on GitHub-Hard {hard}; on GlaiveAI "
        f"{paper['Glaiveai2K']}.",
        f"- MaskBench ({mask['source']}): schemas passing their instance tests out of {mask['schemas']}: "
        f"{passing}; schemas where an invalid instance was accepted: {wrong}.",
    ]  # fmt: skip
