"""What every benchmark shares: the common flags, timing with the device synchronised, and the record of a result.

Scripts import it as ``bench.harness`` (run them from the repository root with ``PYTHONPATH=libs:.``)::

    from bench.harness import add_common_args, pick_device, median_ms, result_header, write_result

    ap = argparse.ArgumentParser()
    add_common_args(ap)              # --tiny, --device {cuda,cpu}, --out DIR
    args = ap.parse_args()
    dev = pick_device(args)          # cuda when available unless --device cpu
    ms = median_ms(fn, dev, repeats=5)
    res = {**result_header(dev, args), "ms": ms}
    write_result(args.out, f"{res['date']}-name", res, ["| ms |", "|---:|", f"| {ms:.2f} |"])

Triton kernels on the CPU (``--tiny --device cpu``, the smoke mode CI runs) go through Triton's interpreter:
``interpret_if_cpu()`` sets ``TRITON_INTERPRET=1`` before ``triton`` is imported and patches the interpreter for
this project's NumPy. The interpreter's bf16 math is wrong: a smoke mode casts kernel inputs to fp32 there.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# NeMo AutoModel, the DeepSeek-V4.1 reference (deepinfer.checkpoint.references.ensure_nemo), installed once for the
# checkout (git-ignored): the V4.1 benchmarks' peer and the tests' reference share it
NEMO_DIR = ROOT / ".deepinfer" / "nemo"


# --- the common flags ---------------------------------------------------------------------------------------------


def add_common_args(ap: argparse.ArgumentParser, out_help: str = "write the result (JSON and markdown) here") -> None:
    """``--tiny`` (the smoke mode: tiny shapes, seconds), ``--device`` (cuda or cpu; default: cuda when available),
    ``--out DIR``."""
    ap.add_argument("--tiny", action="store_true", help="smoke mode: tiny shapes (CI runs it with --device cpu)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--out", type=Path, default=None, help=out_help)


def cpu_requested(argv: Sequence[str] | None = None) -> bool:
    """Whether the command line asks for ``--device cpu`` (read before argparse runs, to set up the interpreter)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1] == "cpu"
        if a == "--device=cpu":
            return True
    return False


def interpret_if_cpu(argv: Sequence[str] | None = None) -> bool:
    """Under ``--device cpu``: run Triton kernels in the interpreter (``TRITON_INTERPRET=1``, set before ``triton``
    is imported) and patch it for NumPy >= 2.4. Returns whether it did."""
    if not cpu_requested(argv):
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    patch_interpreter()
    return True


def patch_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar argument bounding a ``range`` into ``int(np.array([v]))``, which
    NumPy >= 2.4 rejects; upstream fixed it after 3.6. Make ``__index__`` use ``.item()``."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_deepinfer_patched", False):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._deepinfer_patched = True
    interpreter._patch_lang_tensor = patched


def pick_device(args: argparse.Namespace) -> Any:
    """``torch.device`` of ``args.device``, or cuda when available."""
    import torch

    name = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --tiny for the smoke mode)")
    return torch.device(name)


# --- timing --------------------------------------------------------------------------------------------------------


def sync(dev: Any) -> None:
    """Wait for the device (a no-op on the CPU)."""
    import torch

    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: Any) -> float:
    """Seconds of one call of ``fn``, the device synchronised before and after."""
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t


def median_ms(fn: Callable[[], object], dev: Any, repeats: int = 5, warmup: int = 1) -> float:
    """Median ms of ``repeats`` synchronised calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        timed(fn, dev)
    return 1e3 * statistics.median(timed(fn, dev) for _ in range(max(1, repeats)))


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """µs per call of ``fn`` over ``calls`` back-to-back calls after one untimed call: CUDA events around them on a
    GPU, the host's clock otherwise (the CPU smoke modes)."""
    import torch

    fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def cycled_graph_us(fn: Callable[[int], object], copies: int, calls: int, reps: int, dev: Any) -> float:
    """µs per call of ``fn(i)``: on a GPU a CUDA graph of ``calls`` calls (call ``i`` on copy ``i % copies``: weights
    or inputs cycled so that they come from HBM, not L2), the best of ``reps`` replays, launch gaps amortised; on the
    CPU (the smoke modes) the same calls eagerly, the median of ``reps`` rounds on the host's clock."""
    import torch

    if torch.device(dev).type != "cuda":
        return median_ms(lambda: [fn(i % copies) for i in range(calls)], dev, repeats=reps) * 1e3 / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, caches) off the capture
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    del graph
    return best


def copy_gbps(dev: Any, numel: int = 1 << 29) -> float:
    """The device's copy bandwidth (GB/s, bytes read + written) over ``numel`` bf16 elements (1 GiB by default)."""
    import torch

    a = torch.empty(numel, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    us = per_call_us(lambda: b.copy_(a), 10)
    return 2 * a.numel() * a.element_size() / us / 1e3


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank, no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def rel_diff(a: Any, b: Any) -> float:
    """``‖a − b‖ / ‖b‖`` of two tensors, in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# --- the record of a result ----------------------------------------------------------------------------------------


def device_name(dev: Any) -> str:
    """The GPU's name, memory and SMs, or the CPU's processor and core count."""
    import torch

    dev = torch.device(dev)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return f"{p.name} ({p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs)"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def git_commit() -> str | None:
    """The short hash of HEAD, or None outside a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return out or None
    except Exception:  # noqa: BLE001
        return None


def source_hash(*roots: Path) -> str:
    """The first 12 hex digits of a SHA-256 over the Python files (paths from each root's parent, and contents) under
    ``roots``: what ran, even where ``git`` reads another checkout's ``.git`` (an A/B tree unpacked from an
    archive)."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def versions() -> dict[str, Any]:
    """Python, torch, CUDA, deepinfer, transformers and triton versions, the git commit and the hash of the library
    and its kernels."""
    import torch

    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("deepinfer", "transformers", "triton"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    v["git"] = git_commit()
    v["source"] = source_hash(ROOT / "libs" / "deepinfer", ROOT / "kernels")
    return v


def command_line() -> str:
    return " ".join([os.path.basename(sys.executable)] + sys.argv)


def result_header(dev: Any, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """The fields every result starts with: date, device, versions (with the git commit), command line, arguments."""
    head: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": device_name(dev),
        "versions": versions(),
        "command": command_line(),
    }
    if args is not None:
        head["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return head


# the served benchmarks' page size: a multiple of the lcm of the compression ratios (128 at V4-Flash width)
SERVED_PAGE_SIZE = {"cpu": 64, "cuda": 128}
# DeepSeek-V4-Flash's FP8 dense linears, (N, K) each (the kernel benchmarks' shapes)
V4_FLASH_FP8_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
                       "shared_w13": (2048, 4096), "shared_w2": (4096, 2048), "idx_wq_b": (8192, 1024)}  # fmt: skip


def served_checkpoint(tmp: Path, device: str, layers: int) -> Path:
    """A random checkpoint for the served benchmarks, written under ``tmp/model``: on the CPU the tiny model, else
    ``layers`` layers of V4-Flash's width in the official format (FP8 / MXFP4 as stored)."""
    if device == "cpu":
        from deepinfer.checkpoint.tiny import make_tiny_model

        return make_tiny_model(tmp / "model", seed=0)
    from deepinfer.checkpoint.synthetic import flash_config, write_random_checkpoint

    return write_random_checkpoint(tmp / "model", flash_config(layers), seed=0)


def write_json(path: Path, res: dict[str, Any]) -> Path:
    """``res`` as indented JSON at ``path`` (its folder made); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return path


def write_result(out: Path | None, stem: str, res: dict[str, Any], table: Sequence[str]) -> None:
    """Print ``table`` (markdown lines); with ``out``, write ``out/stem.json`` (``res``) and ``out/stem.md``."""
    print("\n".join(table), flush=True)
    if out is not None:
        write_json(out / f"{stem}.json", res)
        (out / f"{stem}.md").write_text("\n".join(table) + f"\n\nCommand: `{res.get('command', command_line())}`\n")


def save_result(out: Path | None, stem: str, res: dict[str, Any], table: Sequence[str]) -> None:
    """``write_result`` without the print (a script that printed its table's lines as they were measured)."""
    if out is not None:
        write_json(out / f"{stem}.json", res)
        (out / f"{stem}.md").write_text("\n".join(table) + f"\n\nCommand: `{res.get('command', command_line())}`\n")
        print(f"wrote {out / stem}.json and .md", flush=True)


# --- what a smoke mode skips ---------------------------------------------------------------------------------------


def note_skipped(skipped: dict[str, str]) -> None:
    """Print one line naming the parts a CPU smoke mode leaves out and why (nothing when none)."""
    if skipped:
        print("skipped on the CPU: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()), flush=True)


# --- the MoE kernels' smoke mode -----------------------------------------------------------------------------------


def mxfp4_experts(e: int, i: int, d: int, g: Any, dev: Any) -> tuple[Any, ...]:
    """Random MXFP4 routed experts ``(w1, s1, w2, s2, w3, s3)``, codes as a checkpoint stores them: ``e`` experts of
    gate / up ``[i, d]`` and down ``[d, i]``, e2m1 codes two a byte, UE8M0 exponents spread over 5 (gate / up
    2^-9…2^-5, down 2^-11…2^-7), drawn from the generator ``g`` (gate, up, down)."""
    import torch

    def packed(n: int, k: int, lo: int) -> tuple[Any, Any]:
        w = torch.randint(0, 256, (e, n, k // 2), generator=g, device=dev, dtype=torch.uint8).view(torch.int8)
        return w, torch.randint(lo, lo + 5, (e, n, k // 32), generator=g, device=dev, dtype=torch.uint8)

    (w1, s1), (w3, s3), (w2, s2) = packed(i, d, 118), packed(i, d, 118), packed(d, i, 116)
    return w1, s1, w2, s2, w3, s3


def in_order(experts: tuple[Any, ...], order: str, copy: bool = True) -> tuple[Any, ...]:
    """``experts`` (``mxfp4_experts``) with the codes in the nibble ``order`` (``deepinfer.quant.nibble_order``):
    copies, or in place with ``copy=False``; the exponents are shared."""
    from deepinfer.quant.nibble_order import to_order

    w1, s1, w2, s2, w3, s3 = experts
    ws = [w.clone() if copy else w for w in (w1, w2, w3)]
    for w in ws:
        to_order(w, order)
    return ws[0], s1, ws[1], s2, ws[2], s3


def moe_smoke(
    args: argparse.Namespace,
    dev: Any,
    stem: str,
    shape: tuple[int, int, int, int],
    limit: float,
    variants: Callable[[tuple, tuple], dict[str, tuple[tuple, dict[str, Any]]]],
    skipped: dict[str, str],
    peaks: dict[str, float],
) -> None:
    """The CPU smoke mode of the prefill MoE benchmarks, whose Gluon kernels compile for sm_90 only: the Triton tiles
    of the same calls (``moe_mxfp4.WGMMA_PREFILL = False``) in Triton's interpreter, on the host's clock.

    ``shape = (E, I, D, K)``: random experts (``mxfp4_experts`` from seed 0, and their copy in the rotate order);
    for each count of ``args.tokens``, random fp32 activations (the interpreter's bf16 math is wrong), a random top-K
    routing and weights. ``variants(plain, rotate)`` names the calls: ``{name: (experts, keyword arguments)}``; each
    ``moe_mxfp4(x, idx, w, *experts, limit, **kwargs)`` is timed over ``args.calls`` calls and compared with
    ``ReferenceOps.moe_mxfp4`` of the same arguments (relative difference), beside the FLOP rooflines at ``peaks``
    (TFLOP/s by name, e.g. ``{"FP8": 1460.0}``). ``skipped`` says what the smoke mode leaves out; with ``args.out``
    the rows go to ``<date>-<stem>.json``."""
    import torch

    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.kernels import moe_mxfp4

    e, i, d, k = shape
    note_skipped(skipped)
    g = torch.Generator(device=dev).manual_seed(0)
    plain = mxfp4_experts(e, i, d, g, dev)
    calls = variants(plain, in_order(plain, "rotate"))
    ref_ops, rows, saved = ReferenceOps("cpu"), [], moe_mxfp4.WGMMA_PREFILL
    moe_mxfp4.WGMMA_PREFILL = False  # the Triton tiles
    try:
        for t in (int(v) for v in str(args.tokens).split(",")):
            x = torch.randn(t, d, generator=g, device=dev)
            idx = torch.rand(t, e, generator=g, device=dev).argsort(dim=1)[:, :k]
            w = torch.rand(t, k, generator=g, device=dev)
            flop = 2 * 3 * t * k * d * i
            roofs = {name: flop / (tflops * 1e12) * 1e6 for name, tflops in peaks.items()}
            for name, (experts, kwargs) in calls.items():
                run = functools.partial(moe_mxfp4.moe_mxfp4, x, idx, w, *experts, limit, **kwargs)
                rel = rel_diff(run(), ref_ops.moe_mxfp4(x, idx, w, *experts, limit, **kwargs))
                us = per_call_us(run, args.calls)
                row = {"T": t, "round": 0, "variant": name, "us": us, "rel_vs_reference": rel}
                rows.append(row | {f"{p.lower()}_roofline_us": r for p, r in roofs.items()})
                roof = ", ".join(f"{p} {r:.3g} µs" for p, r in roofs.items())
                print(f"T={t} round 0: {name} {us:.0f} µs (FLOP roofline {roof}); relative difference to "
                      f"ReferenceOps.moe_mxfp4 {rel:.2e}", flush=True)  # fmt: skip
    finally:
        moe_mxfp4.WGMMA_PREFILL = saved
    if args.out is not None:
        res = {**result_header(dev, args), "shape_E_I_D_k": list(shape), "rows": rows}
        write_json(args.out / f"{res['date']}-{stem}.json", res)
