"""The one source of truth for the performance figures the README states: ``bench/results/latest.json``.

    PYTHONPATH=libs:. python bench/figures.py check            # every figure = its result file; the README agrees
    PYTHONPATH=libs:. python bench/figures.py render --write    # rewrite the README's figures from latest.json
    PYTHONPATH=libs:. python bench/figures.py --tiny --device cpu --out DIR   # smoke mode (CI): check, render

Each entry of latest.json is ``{figure: {key: {"value", "date", "commit", "machine", "file", "source"}}}``: the key
is a batch size, a prompt length or a concurrency; ``file`` is the committed result (relative to bench/results)
and ``source`` the value's place in it (``decode[batch=1].x_roofline``: the ``x_roofline`` of the element of the
``decode`` list whose ``batch`` is 1). ``check`` reads every value back from its file and compares, then renders
the README's block between ``<!-- figures:begin -->`` and ``<!-- figures:end -->`` and compares it with the
README. So a figure in the README is always the one latest.json holds, and that one is always what a committed
result file says. To update a figure: commit the new result, point its entry at it, ``render --write``.

(The roofline and peer of each figure are in its result file, beside it; this script only keeps them traceable.)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LATEST = RESULTS / "latest.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
_STEP = re.compile(r"^(\w+)(?:\[(\w+)=([^\]]+)\])?$")

# the README's sentences, each over the figures of one result file ({figure/key} placeholders, Python formats)
SENTENCES = [
    "{date} at {commit}, {machine}, 4 layers of V4-Flash width, native FP8 / MXFP4 weights: one decode step of the "
    "model at {model_decode_x_roofline/1:.2f}x the HBM roofline at batch 1 and {model_decode_x_roofline/64:.2f}x at "
    "batch 64; prefill at {prefill_fraction_fp8/4096:.1%} of the FP8 peak at 4096 tokens, "
    "{prefill_fraction_fp8/16384:.1%} at 16384; transformers' `DeepseekV4ForCausalLM` in the same run "
    "{peer_decode_ms/1:.1f} ms per decode step at batch 1 against our {model_decode_ms/1:.1f} ms ([result]({file})).",
    "{date} at {commit}, {machine}, the same 4-layer model: the engine's served decode step (`LLMEngine.step()` with "
    "async scheduling: the scheduler, the sampler, detokenisation; 4096-token contexts) {served_decode_ms/1:.2f} ms at "
    "batch 1, {decode_x_roofline/1:.2f}x the HBM roofline, and {served_decode_ms/64:.2f} ms at batch 64, "
    "{decode_x_roofline/64:.2f}x; the synchronous loop in the same run {served_sync_decode_ms/1:.2f} / "
    "{served_sync_decode_ms/64:.2f} ms ([result]({file})).",
    "{date} at {commit}, {machine}, the same 4-layer model served by `deepinfer up` (the NVIDIA worker, a scheduler, "
    "the balancer; gRPC, 512-token prompts, 128 greedy tokens each, all sent at once): "
    "{mesh_over_inprocess/64:.2f}x the output throughput of the in-process engine on the same GPU at concurrency 64, "
    "{mesh_no_kvstore_over_inprocess/64:.2f}x for the mesh without its kvstore in the same run; graph captures fell "
    "inside both timed runs, the first more ([result]({file})).",
    "{date} at {commit}, {machine}, the same model served the same way: {mesh_over_inprocess/1:.2f}x the in-process "
    "engine's output throughput at concurrency 1 ([result]({file})).",
    "{date} at {commit}, {machine}, the same 4-layer model: batch-invariant mode (a sequence's logits bit-identical "
    "in any batch, however its prefill is chunked) at {batch_invariant_over_default/1:.2f}x the default mode's decode "
    "throughput at batch 1 and {batch_invariant_over_default/64:.2f}x at 64 ([result]({file})).",
    "{date} at {commit}, {machine}: a full balancer refuses a 2000-request HTTP burst at p50 "
    "{admission_http_p50_ms/2000:.0f} ms, the bare uvicorn stack in the same run at "
    "{admission_bare_http_p50_ms/2000:.0f} ms ([result]({file})).",
    "{date} at {commit}, {machine}: 180 s of load at concurrency 32 while services are SIGKILLed: "
    "{chaos_completed/32:.0f} requests completed, {chaos_failed/32:.0f} failed, {chaos_exact/32:.0f} token-exact "
    "([result]({file})).",
]
_FIELD = re.compile(r"\{(\w+)/(\w+)(:[^}]*)?\}")


def extract(data: object, source: str) -> object:
    """The value at ``source`` (``a.b[k=v].c``) in a result's JSON."""
    for step in source.split("."):
        m = _STEP.match(step)
        if m is None:
            raise ValueError(f"bad source step {step!r} in {source!r}")
        name, key, want = m.groups()
        data = data[name]  # type: ignore[index]
        if key is not None:
            found = [x for x in data if str(x.get(key)) == want]  # type: ignore[union-attr]
            if len(found) != 1:
                raise ValueError(f"{source!r}: {len(found)} elements of {name!r} with {key}={want}")
            data = found[0]
    return data


def check_values(latest: dict) -> list[str]:
    """Every figure against its result file; the problems found."""
    problems = []
    for figure, by_key in latest.items():
        for key, e in by_key.items():
            where = RESULTS / e["file"]
            missing = {"value", "date", "commit", "machine", "file", "source"} - set(e)
            if missing:
                problems.append(f"{figure}/{key}: missing {sorted(missing)}")
                continue
            if not where.is_file():
                problems.append(f"{figure}/{key}: no result file {e['file']}")
                continue
            try:
                actual = extract(json.loads(where.read_text()), e["source"])
            except (KeyError, ValueError, TypeError) as err:
                problems.append(f"{figure}/{key}: {e['source']} not in {e['file']} ({err})")
                continue
            if actual != e["value"]:
                problems.append(f"{figure}/{key}: latest.json says {e['value']}, {e['file']} says {actual}")
    return problems


def render(latest: dict) -> str:
    """The README's figures block: one bullet per sentence, each from one result file."""
    bullets = []
    for sentence in SENTENCES:
        entries = [latest[f][k] for f, k, _ in _FIELD.findall(sentence)]
        first = entries[0]
        if any(e["file"] != first["file"] for e in entries):
            raise ValueError(f"a sentence mixes result files: {sorted({e['file'] for e in entries})}")
        text = _FIELD.sub(lambda m: format(latest[m[1]][m[2]]["value"], (m[3] or ":")[1:]), sentence)
        text = text.format(
            date=first["date"], commit=first["commit"], machine=first["machine"], file=f"bench/results/{first['file']}"
        )
        bullets.append(
            "\n".join(textwrap.wrap(text, 118, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False))
        )
    return "\n".join(bullets)


def readme_block(text: str) -> str:
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:stop].strip("\n")


def check(latest_path: Path, readme_path: Path) -> list[str]:
    latest = json.loads(latest_path.read_text())
    problems = check_values(latest)
    if not problems and readme_block(readme_path.read_text()) != render(latest):
        problems.append(f"{readme_path.name}'s figures differ from latest.json: run `bench/figures.py render --write`")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="?", choices=["check", "render"], default="check")
    p.add_argument("--write", action="store_true", help="render: rewrite the README's block")
    p.add_argument("--latest", type=Path, default=LATEST)
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--tiny", action="store_true", help="smoke mode: check, and render into --out")
    p.add_argument("--device", default="cpu", help="(no device is used)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.command == "render":
        block = render(json.loads(args.latest.read_text()))
        if args.write:
            text = args.readme.read_text()
            start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
            args.readme.write_text(text[:start] + "\n" + block + "\n" + text[stop:])
        print(block)
        return 0
    problems = check(args.latest, args.readme)
    for line in problems:
        print(f"figures: {line}", file=sys.stderr)
    n = sum(len(v) for v in json.loads(args.latest.read_text()).values())
    print(f"{n} figures in {args.latest.name}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "figures.md").write_text(render(json.loads(args.latest.read_text())) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
