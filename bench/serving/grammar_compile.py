"""Grammar compile latency over a corpus: p50 / p99 cold and cached, in process and through the grammar service.

The corpus (generated, seeded) has ``--schemas`` JSON schemas of ten families — flat objects of mixed types,
nested objects, arrays of objects, anyOf / oneOf unions, patterns, formats, ``$defs`` / ``$ref`` (recursive
too), large enums, tool-call parameters, maps and nullable fields — plus regexes, EBNF grammars, a
``json_object`` and structural tags, all against the DeepSeek-V4 tokenizer (129 280 tokens).

Measured per grammar (each the median of ``--repeats`` runs), then p50 / p99 over the corpus:

* **cold**: :class:`deepinfer.grammar.Compiler` without a cache (limits check, xgrammar compile,
  ``serialize_json``) — and its **peer**, xgrammar's own ``GrammarCompiler`` call with the same options in the
  same run (no checks, no serialization), with the check and serialization shares;
* **cached**: the same compile answered from the compile cache;
* **service**: ``GrammarClient.compile`` against ``python -m services.grammar`` (2 compile processes), the first
  request (cold) and the next (cached): gRPC, the pool and the transfer of the serialized grammar included;
* **deserialize**: what a worker pays to rebuild a grammar from its serialized form.

There is no roofline for graph construction; the floor beside the cold figures is the cached path (a hash
and a dictionary lookup), and through the service the gRPC round trip of a cache hit.

    PYTHONPATH=libs:. python bench/serving/grammar_compile.py --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import ROOT
from deepinfer.grammar import Compiler, GrammarClient, GrammarSpec, build_tokenizer_info  # noqa: E402
from deepinfer.grammar.limits import check_limits  # noqa: E402
from deepinfer.serving.healthcheck import free_port, wait_serving  # noqa: E402

FORMATS = ["email", "date", "date-time", "time", "uuid", "uri", "ipv4", "ipv6", "hostname"]
PATTERNS = [r"^[A-Z]{2}[0-9]{5}$", r"^\+?[0-9]{7,15}$", r"^[a-z0-9_-]{3,16}$", r"^#[0-9a-fA-F]{6}$",
            r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", r"^v[0-9]+\.[0-9]+\.[0-9]+$"]  # fmt: skip
REGEXES = [
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
    r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,6}",
    r"\(?[0-9]{3}\)?[ -]?[0-9]{3}-[0-9]{4}",
    r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)",
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,20}( [A-Z][a-z]{1,20}){0,3}",
    r"-?[0-9]{1,6}(\.[0-9]{1,4})?",
]
EBNF = [
    'root ::= "yes" | "no"',
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
    'factor ::= [0-9]+ | "(" expr ")"',
    'root ::= "SELECT " cols " FROM " ident (" WHERE " ident "=" [0-9]+)? ";"\ncols ::= ident (", " ident)*\n'
    "ident ::= [a-z_] [a-z0-9_]*",
    'root ::= "[" (num ("," num)*)? "]"\nnum ::= "-"? [0-9]+',
]


def scalar(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.25:
        return {"type": "string", "maxLength": rng.choice([8, 16, 32, 64])}
    if r < 0.4:
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 100, 10000])}
    if r < 0.5:
        return {"type": "number"}
    if r < 0.65:
        return {"type": "boolean"}
    if r < 0.8:
        return {"enum": [f"v{i}" for i in range(rng.randint(2, 12))]}
    if r < 0.9:
        return {"type": "string", "format": rng.choice(FORMATS)}
    return {"type": "string", "pattern": rng.choice(PATTERNS)}


def obj(rng: random.Random, n: int, depth: int = 0) -> dict:
    props = {f"f{i}": (obj(rng, rng.randint(2, 5), depth - 1) if depth > 0 and rng.random() < 0.4 else scalar(rng))
             for i in range(n)}  # fmt: skip
    required = [k for k in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def union(rng: random.Random) -> dict:
    """anyOf or oneOf of objects; a oneOf's branches carry a required ``kind`` const each (the schema pass accepts a
    oneOf only when its branches are disjoint: a grammar cannot enforce 'exactly one')."""
    branches = [obj(rng, rng.randint(2, 5)) for _ in range(rng.randint(2, 6))]
    if rng.random() < 0.5:
        return {"anyOf": branches}
    for j, b in enumerate(branches):
        b["properties"]["kind"] = {"const": f"k{j}"}
        b["required"] = ["kind", *b["required"]]
    return {"oneOf": branches}


def corpus(n_schemas: int, seed: int) -> list[tuple[str, GrammarSpec]]:
    rng = random.Random(seed)
    families = {
        "flat": lambda: obj(rng, rng.randint(5, 40)),
        "nested": lambda: obj(rng, rng.randint(3, 6), depth=rng.randint(2, 5)),
        "array": lambda: {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": obj(rng, rng.randint(2, 6)),
                    "minItems": 1,
                    "maxItems": rng.choice([3, 10, 50]),
                }
            },
            "required": ["items"],
        },
        "union": lambda: union(rng),
        "pattern": lambda: {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "pattern": rng.choice(PATTERNS)} for i in range(rng.randint(2, 8))
            },
        },
        "format": lambda: {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "format": rng.choice(FORMATS)} for i in range(rng.randint(2, 8))
            },
        },
        "ref": lambda: {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": scalar(rng),
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 4},
                    },
                    "required": ["value"],
                },
                "addr": obj(rng, 4),
            },
            "type": "object",
            "properties": {
                "tree": {"$ref": "#/$defs/node"},
                "home": {"$ref": "#/$defs/addr"},
                "work": {"$ref": "#/$defs/addr"},
            },
        },
        "enum": lambda: {
            "type": "object",
            "properties": {
                "choice": {"enum": [f"option_{i}" for i in range(rng.choice([100, 300, 1000]))]},
                "other": {"type": "boolean"},
            },
            "required": ["choice"],
        },
        "tool": lambda: {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "details": obj(rng, rng.randint(1, 4)),
            },
            "required": ["location"],
            "additionalProperties": False,
        },
        "map": lambda: {
            "type": "object",
            "additionalProperties": {"type": ["string", "null"], "maxLength": 20},
            "maxProperties": rng.choice([5, 20]),
        },
    }
    names = list(families)
    out = [(f"json:{names[i % len(names)]}", GrammarSpec("json_schema", json.dumps(families[names[i % len(names)]]())))
           for i in range(n_schemas)]  # fmt: skip
    out += [("regex", GrammarSpec("regex", r)) for r in REGEXES]
    out += [("ebnf", GrammarSpec("ebnf", g)) for g in EBNF]
    out.append(("json_object", GrammarSpec("json_object", "")))
    tool = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    out.append(("structural_tag", GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool>"], "tags": [{"begin": "<tool>get_weather", "end": "</tool>",
        "content": {"type": "json_schema", "json_schema": tool}}]}}))))  # fmt: skip
    return out


def _cpu_jiffies() -> tuple[int, int]:
    """(idle, total) jiffies of all cores since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def cpu_busy(interval_s: float = 1.0) -> float:
    """Fraction of all cores busy over ``interval_s``."""
    idle0, total0 = _cpu_jiffies()
    time.sleep(interval_s)
    idle1, total1 = _cpu_jiffies()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_idle(max_s: float) -> float:
    """Wait until other processes leave the cores (< 10 % busy, three readings in a row) or ``max_s`` passes."""
    deadline, calm, busy = time.monotonic() + max_s, 0, 1.0
    while calm < 3 and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
        calm = calm + 1 if busy < 0.10 else 0
    return busy


class OtherLoad:
    """The share of the cores that other processes used while this one ran (its own CPU time subtracted)."""

    def __enter__(self) -> OtherLoad:
        self.jiffies, self.cpu = _cpu_jiffies(), sum(os.times()[:2])
        return self

    def __exit__(self, *exc: object) -> None:
        idle1, total1 = _cpu_jiffies()
        idle0, total0 = self.jiffies
        hz = os.sysconf("SC_CLK_TCK")
        busy_s = ((total1 - total0) - (idle1 - idle0)) / hz
        own_s = sum(os.times()[:2]) - self.cpu
        self.share = max(0.0, busy_s - own_s) / max(1e-9, (total1 - total0) / hz)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def timed(fn, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def in_process(specs: list[tuple[str, GrammarSpec]], repeats: int) -> list[dict]:
    import xgrammar

    t0 = time.perf_counter()
    info = build_tokenizer_info()
    print(f"TokenizerInfo: {time.perf_counter() - t0:.2f} s", flush=True)
    cold, cached = Compiler(cache_bytes=0, json_whitespace=0), Compiler(cache_bytes=1 << 30, json_whitespace=0)
    peer = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compact = {"any_whitespace": False, "separators": (",", ":")}

    def xgr(spec: GrammarSpec) -> object:
        if spec.kind == "regex":
            return peer.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return peer.compile_grammar(spec.text)
        if spec.kind == "json_object":
            return peer.compile_json_schema('{"type":"object"}', strict_mode=False, **compact)
        if spec.kind == "structural_tag":
            return peer.compile_structural_tag(spec.text)
        return peer.compile_json_schema(spec.text, **compact)

    cold.compile(specs[0][1])  # warm-up: xgrammar's first call
    rows = []
    for family, spec in specs:
        row = {"family": family, "kind": spec.kind, "bytes": len(spec.text.encode())}
        row["cold_ms"] = 1e3 * timed(lambda s=spec: cold.compile(s), repeats)
        row["xgrammar_ms"] = 1e3 * timed(lambda s=spec: xgr(s), repeats)
        row["check_ms"] = 1e3 * timed(lambda s=spec: check_limits(s, cold.limits), repeats)
        compiled = xgr(spec)
        row["serialize_ms"] = 1e3 * timed(compiled.serialize_json, repeats)
        text = compiled.serialize_json()
        row["serialized_bytes"] = len(text)
        row["deserialize_ms"] = 1e3 * timed(lambda t=text: xgrammar.CompiledGrammar.deserialize_json(t, info), repeats)
        cached.compile(spec)
        row["cached_ms"] = 1e3 * timed(lambda s=spec: cached.compile(s), max(repeats, 5))
        rows.append(row)
        cold_ms, peer_ms, hit_us = row["cold_ms"], row["xgrammar_ms"], 1e3 * row["cached_ms"]
        print(f"  {family:16s} {row['bytes']:6d} B  cold {cold_ms:8.2f} ms  xgrammar {peer_ms:8.2f} ms  "
              f"cached {hit_us:7.1f} us", flush=True)  # fmt: skip
    return rows


async def through_service(specs: list[tuple[str, GrammarSpec]], rows: list[dict]) -> float:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "libs"), str(ROOT)])
    env["DEEPINFER_LOG_LEVEL"] = "warning"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "services.grammar", "--port", str(port)], cwd=ROOT, env=env)
    try:
        await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", 120.0, proc)
        start_s = time.perf_counter() - t0
        client = GrammarClient(f"127.0.0.1:{port}")
        for (_, spec), row in zip(specs, rows):
            for field in ("service_cold_ms", "service_cached_ms"):
                t = time.perf_counter()
                await client.compile(spec, timeout_s=10.0)
                row[field] = 1e3 * (time.perf_counter() - t)
        await client.close()
        return start_s
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def summary(rows: list[dict], field: str) -> dict:
    values = [r[field] for r in rows if field in r]
    return {"p50": pct(values, 50), "p99": pct(values, 99), "max": max(values), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", type=int, default=60, help="JSON schemas in the corpus (>= 50)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per grammar (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-service", action="store_true", help="skip the measurement through the grammar service")
    ap.add_argument("--wait-idle", type=float, default=0.0, help="first wait up to S s for idle cores")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--tiny", action="store_true", help="smoke mode: 10 schemas (one per family), one run each, no service"
    )
    ap.add_argument("--device", choices=["cpu"], default="cpu", help="only cpu: grammars compile on the host")
    args = ap.parse_args()
    if args.tiny:
        args.schemas, args.repeats, args.no_service = 10, 1, True
    busy = wait_idle(args.wait_idle) if args.wait_idle > 0 else cpu_busy()
    print(f"cores busy before the run: {100 * busy:.0f} %", flush=True)
    specs = corpus(args.schemas, args.seed)
    print(f"{len(specs)} grammars ({args.schemas} JSON schemas)", flush=True)
    with OtherLoad() as other:
        rows = in_process(specs, args.repeats)
    start_s = None if args.no_service else asyncio.run(through_service(specs, rows))
    machine = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    fields = ["cold_ms", "xgrammar_ms", "check_ms", "serialize_ms", "cached_ms", "service_cold_ms",
              "service_cached_ms", "deserialize_ms", "serialized_bytes", "bytes"]  # fmt: skip
    json_rows = [r for r in rows if r["kind"] == "json_schema"]
    result = {
        "machine": machine, "python": platform.python_version(), "command": " ".join(sys.argv),
        "date": datetime.date.today().isoformat(), "grammars": len(rows), "json_schemas": len(json_rows),
        "cpu_busy_before": busy, "other_load_in_process": other.share, "service_start_s": start_s,
        "all": {f: summary(rows, f) for f in fields if any(f in r for r in rows)},
        "json_schema": {f: summary(json_rows, f) for f in fields if any(f in r for r in json_rows)}, "rows": rows,
    }  # fmt: skip
    a, j = result["all"], result["json_schema"]

    def line(label: str, f: str, unit: float = 1.0, fmt: str = "{:.2f}") -> str:
        if f not in a:
            return f"| {label} | – | – | – | – |"
        cells = [fmt.format(x[f][q] * unit) for x in (j, a) for q in ("p50", "p99")]
        return f"| {label} | " + " | ".join(cells) + " |"

    lines = [
        f"# grammar compile latency on {machine}", "",
        f"{len(rows)} grammars: {len(json_rows)} generated JSON schemas (10 families, seed {args.seed}), "
        f"{len(REGEXES)} regexes, {len(EBNF)} EBNF grammars, a json_object and a structural tag; DeepSeek-V4 "
        f"tokenizer; compact JSON; each figure the median of {args.repeats} runs, then p50 / p99 over the grammars.",
        "",
        "| ms (µs where marked) | JSON schemas p50 | p99 | all grammars p50 | p99 |",
        "|---|---:|---:|---:|---:|",
        line("**cold**: Compiler, no cache (check + compile + serialize)", "cold_ms"),
        line("peer: xgrammar GrammarCompiler alone, same options", "xgrammar_ms"),
        line("limits check", "check_ms"),
        line("serialize_json", "serialize_ms"),
        line("**cached** (µs): Compiler cache hit", "cached_ms", 1e3, "{:.1f}"),
        line("**service cold**: GrammarClient → grammar service, first request", "service_cold_ms"),
        line("**service cached**: the same request again (gRPC floor)", "service_cached_ms"),
        line("worker side: deserialize_json", "deserialize_ms"),
        line("serialized grammar (KB)", "serialized_bytes", 1e-3, "{:.0f}"),
        "",
        f"Slowest cold compile: {a['cold_ms']['max']:.1f} ms; grammar service start (2 compile processes): "
        + (f"{start_s:.1f} s" if start_s is not None else "not measured")
        + f"; cores busy before the run {100 * busy:.0f} %, used by other processes during the in-process "
        f"measurements {100 * other.share:.0f} %.",
    ]  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{datetime.date.today().isoformat()}-grammar-compile-cpu"
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        cmd = "PYTHONPATH=libs:. python " + " ".join(sys.argv)
        (args.out / f"{stem}.md").write_text(text + f"\n\nCommand: `{cmd}`\n")


if __name__ == "__main__":
    main()
