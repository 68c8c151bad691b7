"""Conformance on real schemas: a seeded sample of JSONSchemaBench (40 schemas from each of eight sets), compiled
and generated from by three grammar engines over the DeepSeek-V4 tokenizer in the same run, no model involved.

Engines (``conformance_engines.py``): **ours** (``deepinfer.grammar.Compiler`` with the xgrammar backend: limits,
schema pass, xgrammar), the peers on the raw schema, **xgrammar** alone (same options, no pass) and **llguidance**,
and **auto** (ours with ``DEEPINFER_GRAMMAR_BACKEND=auto``: xgrammar unless the pass or xgrammar refuses the
schema, then llguidance on the raw schema; an xgrammar compile past 3/4 of ``--compile-timeout`` gives way to
llguidance in the time left, as the grammar service does). Each engine compiles each schema in a worker process
(killed past ``--compile-timeout``), then
generates ``--walks`` outputs under its own token mask with random, adversarial and closing choices; the
``jsonschema`` package judges every finished output against the schema as written (formats checked).

Per set and engine:

* **coverage**: compiled; refused cleanly, the message naming the keyword (ours: a JSON pointer to it); refused
  otherwise (a limit, an unsatisfiable schema, a compile error); timed out or crashed;
* **compliance**: schemas with every walk finished and every output valid, over all schemas of the set (the
  benchmark's "empirical coverage" with a random walk standing in for the model); outputs valid / finished;
* **silent violations**: finished outputs (EOS accepted) that ``jsonschema`` rejects; the target is 0;
* **compile time** p50 / p99 over the compiled schemas (the engine's compile call; llguidance builds its lexer
  lazily, so the first mask is reported beside it).

    PYTHONPATH=libs:. python bench/serving/schema_conformance.py --device cpu --out bench/results/serving
    # the committed sample from a checkout of github.com/guidance-ai/jsonschemabench:
    PYTHONPATH=libs:. python bench/serving/schema_conformance.py --make-sample CHECKOUT
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import queue
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import ROOT, add_common_args, pick_device, result_header, save_result
from bench.serving.conformance_engines import available_engines, compact, serve
from bench.serving.conformance_report import PUBLISHED, compact_walks, summarize, table
from services.grammar.pool import AUTO_XGRAMMAR_SHARE

SAMPLE = ROOT / "bench" / "serving" / "data" / "jsonschemabench_sample.jsonl.gz"
SETS = ("Github_easy", "Github_medium", "Github_hard", "Kubernetes", "Snowplow", "WashingtonPost", "Glaiveai2K",
        "JsonSchemaStore")  # fmt: skip


def make_sample(checkout: Path, per_set: int, seed: int, max_bytes: int) -> None:
    """Draw ``per_set`` schemas of each set (seeded shuffle of the sorted file names; schemas over ``max_bytes``
    as compact JSON skipped) from a JSONSchemaBench checkout into ``SAMPLE`` and its ``.meta.json``."""
    rows, meta = [], {"source": "https://github.com/guidance-ai/jsonschemabench (data/)", "seed": seed,
                      "per_set": per_set, "max_schema_bytes": max_bytes, "sets": {}}  # fmt: skip
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    meta["commit"] = commit.stdout.strip() or None
    for name in SETS:
        texts, unreadable = {}, 0
        for f in sorted((checkout / "data" / name).glob("*.json")):
            try:
                texts[f.stem] = compact(json.loads(f.read_text(encoding="utf-8")))
            except ValueError:  # a file a partial copy lacks: counted, left out of the draw
                unreadable += 1
        order = sorted(texts)
        random.Random(f"{seed}:{name}").shuffle(order)
        picked = [i for i in order if len(texts[i].encode()) <= max_bytes][:per_set]
        over = sum(len(t.encode()) > max_bytes for t in texts.values())
        meta["sets"][name] = {"schemas": len(texts), "over_max_bytes": over, "unreadable": unreadable,
                             "sampled": len(picked)}  # fmt: skip
        rows += [json.dumps({"set": name, "id": i, "schema": json.loads(texts[i])}, ensure_ascii=False)
                 for i in picked]  # fmt: skip
    SAMPLE.parent.mkdir(parents=True, exist_ok=True)
    SAMPLE.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode(), 9, mtime=0))
    SAMPLE.with_name(SAMPLE.name.replace(".jsonl.gz", ".meta.json")).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(rows)} schemas ({SAMPLE.stat().st_size / 1e3:.0f} KB) to {SAMPLE}")


def load_sample(per_set: int) -> list[dict]:
    rows = [json.loads(line) for line in gzip.decompress(SAMPLE.read_bytes()).decode().splitlines() if line]
    taken: dict[str, int] = {}
    out = []
    for row in rows:
        if taken.get(row["set"], 0) < per_set:
            taken[row["set"]] = taken.get(row["set"], 0) + 1
            out.append(row)
    return out


class Worker:
    """One engine process (``conformance_engines.serve``), restarted after a timeout or a crash."""

    def __init__(self) -> None:
        self.proc: Any = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()
        if not self.conn.poll(300) or self.conn.recv() != ("ready",):
            raise RuntimeError("the engine worker did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
            self.proc = None

    def _recv(self, timeout_s: float) -> Any:
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def run(
        self, engine: str, schema: str, seeds: list[int], max_tokens: int, args: argparse.Namespace,
        timeout_s: float | None = None,
    ) -> dict:  # fmt: skip
        if self.proc is None:
            self.start()
        self.conn.send((engine, schema, seeds, max_tokens))
        got = self._recv(args.compile_timeout if timeout_s is None else timeout_s)
        if got is None:
            crashed = not self.proc.is_alive()
            self.stop()
            return {"status": "crash" if crashed else "timeout"}
        _, compile_ms, first_ms, message = got
        row = {"compile_ms": compile_ms, "first_mask_ms": first_ms, "message": message}
        walks = self._recv(args.walk_timeout)
        if walks is None:
            self.stop()
            return {**row, "status": "compiled", "walks": [], "walk_timeout": True}
        return {**row, "status": "compiled" if not message else "refused", "walks": walks[1]}


def judge(schema: Any, text: str) -> str:
    """``valid``, ``invalid: <why>`` or ``unjudged: <why>`` (the validator cannot check this schema)."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    try:
        value = json.loads(text)  # strict: a raw control character in a string is invalid JSON
    except ValueError as e:
        return f"invalid: not JSON ({e})"
    try:
        cls = validator_for(schema, Draft202012Validator)
        error = next(iter(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)), None)
    except Exception as e:  # noqa: BLE001 - remote $ref, a pattern Python's re rejects, a malformed schema
        return f"unjudged: {type(e).__name__}: {str(e)[:200]}"
    return "valid" if error is None else f"invalid: {error.message[:300]}"


def measure(row: dict, engines: tuple[str, ...], worker: Worker, args: argparse.Namespace) -> dict:
    """Every engine on one schema (in the same worker, one after the other); outputs judged here."""
    text, seeds = compact(row["schema"]), [args.seed * 1000 + i for i in range(args.walks)]
    out = {"set": row["set"], "id": row["id"], "bytes": len(text.encode())}
    for engine in engines:
        if engine == "auto":  # the grammar service's fallback: xgrammar gets 3/4 of the limit, llguidance the rest
            t0, share = time.perf_counter(), AUTO_XGRAMMAR_SHARE * args.compile_timeout
            got = worker.run(engine, text, seeds, args.max_tokens, args, share)
            if got["status"] == "timeout":
                left = args.compile_timeout - (time.perf_counter() - t0)
                got = worker.run("auto_llg", text, seeds, args.max_tokens, args, left) | {"fallback": True}
        else:
            got = worker.run(engine, text, seeds, args.max_tokens, args)
        walks = [(e, t, n, judge(row["schema"], t) if e == "eos" else None) for e, t, n in got.get("walks", [])]
        got["walks"] = [
            {"ended": e, "tokens": n, "verdict": v} | ({"text": t[:400]} if v and v[0] == "i" else {})
            for e, t, n, v in walks
        ]  # the text of a violation only (the results file stays small)
        out[engine] = got
    return out


def run_all(rows: list[dict], engines: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    pool: queue.Queue[Worker] = queue.Queue()
    for _ in range(args.workers):
        pool.put(Worker())
    done: list[dict] = []
    t0 = time.perf_counter()

    def one(row: dict) -> dict:
        worker = pool.get()
        try:
            result = measure(row, engines, worker, args)
        finally:
            pool.put(worker)
        done.append(result)
        cells = "  ".join(f"{e} {result[e]['status']}" for e in engines)
        print(f"[{len(done):3d}/{len(rows)} {time.perf_counter() - t0:5.0f} s] {row['set']:15s} {row['id']:10s} "
              f"{cells}", flush=True)  # fmt: skip
        return result

    try:
        with ThreadPoolExecutor(args.workers) as ex:
            results = list(ex.map(one, rows))
    finally:
        while not pool.empty():
            pool.get().stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--per-set", type=int, default=40, help="schemas of each set (the sample's first N)")
    ap.add_argument("--walks", type=int, default=4, help="outputs generated per schema and engine")
    ap.add_argument("--max-tokens", type=int, default=320, help="token budget of a walk (closing from half)")
    ap.add_argument("--compile-timeout", type=float, default=20.0, help="seconds before a compile is killed")
    ap.add_argument("--walk-timeout", type=float, default=120.0, help="seconds for one schema's walks")
    ap.add_argument("--workers", type=int, default=2, help="engine processes (one schema each at a time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--make-sample", type=Path, default=None, metavar="CHECKOUT",
                    help="draw the committed sample from a JSONSchemaBench checkout, then exit")  # fmt: skip
    ap.add_argument("--max-schema-bytes", type=int, default=65536, help="with --make-sample: skip larger schemas")
    args = ap.parse_args()
    if args.make_sample is not None:
        return make_sample(args.make_sample, 40, args.seed, args.max_schema_bytes)
    if args.tiny:
        args.per_set, args.walks, args.max_tokens, args.workers = 1, 1, 96, 1
    dev = pick_device(args)
    engines = available_engines()
    rows = load_sample(args.per_set)
    print(f"{len(rows)} schemas, engines {', '.join(engines)}, {args.walks} walks each", flush=True)
    results = run_all(rows, engines, args)
    summary = summarize(results, engines)
    for r in results:
        for e in engines:
            r[e]["walks"] = compact_walks(r[e].get("walks", []))
    res = {**result_header(dev, args), "engines": engines, "published": PUBLISHED, "summary": summary,
           "schemas": results}  # fmt: skip
    lines = table(summary, engines, args, len(rows))
    print("\n".join(lines), flush=True)
    save_result(args.out, f"{res['date']}-schema-conformance-cpu", res, lines)


if __name__ == "__main__":
    sys.exit(main())
