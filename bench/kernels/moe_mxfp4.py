"""MXFP4 routed experts (W4A16, ``kernels.moe_mxfp4``) against the bf16 kernels on the decoded experts, one GPU.

V4-Flash's expert shapes (E=256, D=4096, I=2048, top-6), random MXFP4 experts built on the GPU (every byte value,
e8m0 exponents 116..122) and their bf16 decoding (``dequantize_experts``, the peer's weights: 12.9 GB). For each
token count T, ``--calls`` routings drawn uniformly at random (top-6 of 256) are captured in one CUDA graph per
implementation and the graph is replayed (CUDA events; the time per call is the replay's median over ``--reps``
divided by the calls): launch overhead is amortised, and consecutive calls touch different experts, so at small T
the weights come from HBM, not L2.

Columns: ``moe_mxfp4`` (``VARIANTS``, interleaved: unsplit, the codes as stored, a copy in the shift order of
``quant.nibble_order``, that with the weight tiles read by the TMA unit, and a copy in the rotate order with TMA,
with whether all four give bit-identical outputs; then split-K, ``kernels.moe_mxfp4_split``, on shift+TMA:
``SPLIT_K`` = None, the auto rule, with its (gate/up, down) pieces, and forced 2, 4, 8 pieces, and on rotate+TMA
with the auto rule (the default, what the model runs), with their largest relative difference from the unsplit
rotate+TMA output); the peers ``moe_triton`` and
``moe_grouped_mm`` (kernels/moe.py) on the bf16 experts; the HBM roofline of the MXFP4 call (bytes of the distinct
experts its routing touches, weights and scales, over ``--hbm`` B/s, 4.8 TB/s by default); the FLOP roofline
``2·3·T·k·D·I / --flops`` (989 TFLOP/s dense bf16); the bandwidth the MXFP4 call reached; and ``roof/time`` =
max(rooflines) / time. A device-to-device copy measured in the same run gives the copy bandwidth actually reachable.
``--sweep`` instead times ``moe_mxfp4`` under a list of configurations at every T (for tuning ``MX_DECODE`` /
``MX_PREFILL``).

Run on one GPU from the repository root::

    PYTHONPATH=libs:. python bench/kernels/moe_mxfp4.py --out bench/results
    PYTHONPATH=libs:. python bench/kernels/moe_mxfp4.py --sweep --calls 4 --tokens 1,16,64,256,4096
    PYTHONPATH=libs:. python bench/kernels/moe_mxfp4.py --shape 5120,2304,384,6 --no-peers  # V4.1-Flash's experts

(``--sweep`` lists the µs of every candidate, in every order of the codes, and its relative error against
the portable decode. ``--profile 1,64`` first prints the CUDA time of each kernel of a call at those T.)

    PYTHONPATH=libs:. python bench/kernels/moe_mxfp4.py --tiny --device cpu --out /tmp/x   # smoke: interpreter

The smoke mode runs every variant and the peers at tiny experts (D = I = 64, E = 8, top 2, T = 2, one routing, fp32
activations) with the kernels in Triton's interpreter, eager calls on the host's clock, beside the same rooflines.
There the variants differ only by their nibble order and split-K (the PTX decode, the TMA tiles and the Gluon kernels
are CUDA-only: the interpreter runs the portable tiles); CUDA graphs and ``--profile`` are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys

import torch

from bench.harness import (
    add_common_args,
    copy_gbps,
    device_name,
    interpret_if_cpu,
    median_ms,
    mxfp4_experts,
    note_skipped,
    pick_device,
)

interpret_if_cpu()  # --device cpu: Triton's interpreter, set before the kernels are imported

from deepinfer.kernels.moe import MoEConfig, moe_grouped_mm, moe_triton  # noqa: E402
from deepinfer.kernels.moe_mxfp4 import moe_mxfp4, pick_config_mxfp4, splits_mxfp4  # noqa: E402
from deepinfer.quant.native import dequantize_experts  # noqa: E402
from deepinfer.quant.nibble_order import to_order  # noqa: E402

E, D, I, K = 256, 4096, 2048, 6
LIMIT = 10.0
DEV = "cuda"  # main sets it: cpu in the smoke mode (the kernels in Triton's interpreter)

# --sweep: (config, swap) candidates, the decode ones timed for T <= 256, the
# prefill ones for T >= 256
SWEEP_DECODE = [(MoEConfig(*c), swap) for c, swap in [
    ((16, 128, 128, 4, 3), 0), ((16, 64, 128, 2, 3), 0), ((16, 128, 128, 2, 3), 0), ((16, 64, 256, 2, 3), 0),
    ((16, 64, 128, 2, 4), 0), ((16, 32, 128, 1, 3), 0),
]]  # fmt: skip
# --regs: the decode tiles under a register cap (ptxas .maxnreg), with fewer stages (shared memory) to match
SWEEP_REGS = [(MoEConfig(*c), 0) for c in [
    (16, 64, 128, 2, 3), (16, 64, 128, 2, 3, 128), (16, 64, 128, 2, 2, 128), (16, 64, 128, 2, 2),
    (16, 64, 128, 2, 3, 96), (16, 64, 128, 2, 2, 96), (16, 64, 128, 2, 4, 128), (16, 128, 128, 4, 2, 128),
    (16, 32, 128, 1, 3, 128), (16, 64, 128, 2, 2, 112),
]]  # fmt: skip
SWEEP_PREFILL = [(MoEConfig(*c), swap) for c, swap in [
    ((64, 128, 128, 8, 3), 1), ((128, 128, 128, 8, 3), 1), ((128, 256, 128, 8, 3), 1), ((128, 128, 256, 8, 3), 1),
    ((64, 128, 64, 4, 4), 1),
]]  # fmt: skip
# the same tiles with the activations as the MMA's first operand: both operands from shared memory, so the wgmma of
# a K step runs while the next is decoded (with the decoded weights in registers as its first operand, every wgmma
# waits for the one before: bench/kernels/moe_sass.py)
SWEEP_PREFILL_NOSWAP = [(MoEConfig(*c), 0) for c in [
    (128, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 128, 4, 3),
    (64, 128, 64, 4, 4), (128, 128, 128, 4, 3), (64, 64, 128, 4, 3),
]]  # fmt: skip


# between decode and long prefills (T = 512 .. 4096 at top-6 of 256: 12 .. 96 slots per expert)
SWEEP_MID = [(MoEConfig(*c), swap) for c, swap in [
    ((32, 64, 128, 2, 3), 0), ((32, 128, 128, 4, 3), 1), ((64, 64, 128, 4, 3), 1),
]]  # fmt: skip


def sweep_variants(t, regs=False):
    if regs:
        return SWEEP_REGS
    if t <= 64:
        return SWEEP_DECODE
    if t <= 256:
        return SWEEP_DECODE + SWEEP_PREFILL[:1]
    if t < 1024:
        return SWEEP_PREFILL[:2] + SWEEP_MID
    return SWEEP_PREFILL[:2] + SWEEP_MID + SWEEP_PREFILL_NOSWAP


def run_variant(cfg, swap, x, i, w, mx, order="plain"):
    import deepinfer.kernels.moe_mxfp4 as mod

    mod.SWAP_AB = bool(swap)
    try:
        return moe_mxfp4(x, i, w, *mx, LIMIT, config=cfg, order=order)
    finally:
        mod.SWAP_AB = None


VARIANTS = {  # name -> (nibble order, TMA weight tiles, SPLIT_K): unsplit (the codes as stored, the shift decode,
    # then with TMA, the rotate decode with TMA), then split-K on shift+TMA (the auto rule, then forced) and on
    # rotate+TMA (the auto rule: what the model runs)
    "plain": ("plain", False, 1),
    "shift": ("shift", False, 1),
    "shift_tma": ("shift", True, 1),
    "rotate_tma": ("rotate", True, 1),
    "split_auto": ("shift", True, None),
    "split2": ("shift", True, 2),
    "split4": ("shift", True, 4),
    "split8": ("shift", True, 8),
    "rotate_auto": ("rotate", True, None),
    "rotate_wgmma": ("rotate", True, None),  # the same, with the Gluon kernels at the prefill tiles
}
UNSPLIT = ("plain", "shift", "shift_tma", "rotate_tma")
DEFAULT = "rotate_wgmma"


def variants(inputs, mx, sx, reps, rounds=2):
    """µs per call of each of ``VARIANTS`` (the best of ``rounds`` interleaved rounds) and their outputs on
    ``inputs[0]``."""
    import deepinfer.kernels.moe_mxfp4 as mod

    times, outs = {}, {}
    try:
        for _ in range(rounds):
            for name, (order, tma, split) in VARIANTS.items():
                mod.TMA_WEIGHTS, mod.SPLIT_K = tma, split
                mod.WGMMA_PREFILL = name == "rotate_wgmma"
                ws = sx.get(order, mx)
                fn = lambda x, i, w, ws=ws, order=order: moe_mxfp4(x, i, w, *ws, LIMIT, order=order)  # noqa: E731
                us = time_graph(fn, inputs, reps)
                times[name] = min(us, times.get(name, us))
                outs[name] = fn(*inputs[0])
    finally:
        mod.TMA_WEIGHTS, mod.SPLIT_K, mod.WGMMA_PREFILL = True, None, None
    return times, outs


def ordered(mx):
    """Copies of the experts with their codes in the shift and the rotate order (``quant.nibble_order``)."""
    sets = {}
    for order in ("shift", "rotate"):
        out = list(mx)
        for j in (0, 2, 4):
            out[j] = mx[j].clone()
            to_order(out[j], order)
        sets[order] = tuple(out)
    return sets


def profile(t, mx, sx, dev) -> None:
    """The kernels of ``moe_mxfp4`` at ``t`` tokens, in every order: CUDA µs per call by kernel name."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inputs = routings(t, 8, dev, seed=7 + t)
    for order, weights in (("plain", mx), *sx.items()):
        for x, i, w in inputs:
            moe_mxfp4(x, i, w, *weights, LIMIT, order=order)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for x, i, w in inputs:
                moe_mxfp4(x, i, w, *weights, LIMIT, order=order)
            torch.cuda.synchronize()
        print(f"\nT={t}, {order} order: CUDA time per call by kernel")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def experts(dev):
    return mxfp4_experts(E, I, D, torch.Generator(device=dev).manual_seed(0), dev)


def routings(t, n, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(t, D, generator=g, device=dev) * 0.5
        x = x.bfloat16() if x.is_cuda else x  # the interpreter's bf16 math is wrong: fp32 on the CPU
        idx = torch.rand(t, E, generator=g, device=dev).topk(K, dim=1).indices
        w = torch.rand(t, K, generator=g, device=dev)
        out.append((x, idx, w))
    return out


def expert_bytes(mx) -> int:
    return sum(t[0].numel() * t.element_size() for t in mx)


def time_graph(fn, inputs, reps) -> float:
    """Median µs per call of ``fn`` over the ``inputs`` (one graph holds a call on each); on the CPU (the smoke mode)
    eager calls, the median of ``reps`` rounds on the host's clock."""
    if DEV != "cuda":
        return median_ms(lambda: [fn(*args) for args in inputs], DEV, repeats=reps) * 1e3 / len(inputs)
    for args in inputs:
        fn(*args)  # compile, and warm the allocator outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(inputs))
    del graph
    return statistics.median(times)


def copy_bandwidth(dev) -> float:
    if dev.type != "cuda":  # the smoke mode: the host's copy
        return copy_gbps(dev, numel=1 << 20) * 1e9
    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), [()] * 8, 5)
    return 2 * src.numel() * 4 / (us * 1e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,16,64,256,1024,4096")
    p.add_argument("--calls", type=int, default=8, help="routings (calls) per CUDA graph")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hbm", type=float, default=4.8e12, help="HBM bytes/s for the roofline")
    p.add_argument("--flops", type=float, default=989e12, help="dense bf16 FLOP/s for the roofline")
    p.add_argument("--sweep", action="store_true", help="time moe_mxfp4 under each config of SWEEP instead")
    p.add_argument("--regs", action="store_true", help="--sweep: the decode tiles under register caps (rotate order)")
    p.add_argument("--rotate-only", action="store_true", help="--sweep: the rotate order only (what the model runs)")
    p.add_argument("--no-peers", action="store_true", help="skip the bf16 peers (no 12.9 GB decoded copy)")
    p.add_argument("--profile", default="", help="token counts to profile by kernel (both nibble orders), e.g. 1,64")
    add_common_args(p, out_help="directory for the JSON results")
    p.add_argument("--shape", default="4096,2048,256,6", help="D,I,E,k: V4-Flash's by default; V4.1: 5120,2304,384,6")
    args = p.parse_args()
    global D, I, E, K, DEV
    dev = pick_device(args)
    DEV = dev.type
    if args.tiny:  # tiny experts, one routing of two tokens, one round
        args.shape, args.tokens, args.calls, args.reps = "64,64,8,2", "2", 1, 1
    if dev.type != "cuda":
        skipped = {
            "CUDA graphs": "eager calls on the host's clock",
            "a second round": "one round of the variants",
            "PTX decode, TMA tiles, Gluon kernels": "CUDA-only: the variants run the portable tiles",
        }
        if args.profile:
            args.profile = ""
            skipped["--profile"] = "CUDA kernel times"
        note_skipped(skipped)
    D, I, E, K = (int(v) for v in args.shape.split(","))
    tokens = [int(t) for t in args.tokens.split(",")]
    mx = experts(dev)
    sx = ordered(mx)
    per_expert = expert_bytes(mx)
    for t in [int(t) for t in args.profile.split(",") if t]:
        profile(t, mx, sx, dev)
    deq = None
    if not (args.no_peers or args.sweep):
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
        deq = tuple(dequantize_experts(w, s, dt) for w, s in (mx[0:2], mx[2:4], mx[4:6]))
    copy_bw = copy_bandwidth(dev)
    rows = []
    for t in tokens:
        inputs = routings(t, args.calls, dev, seed=t)
        touched = statistics.mean(int(torch.unique(idx).numel()) for _, idx, _ in inputs)
        row = {
            "T": t,
            "experts_touched": touched,
            "config": str(pick_config_mxfp4(t * K, E)),
            "auto_split": [p for p, _ in splits_mxfp4(t * K, E, I, D, pick_config_mxfp4(t * K, E))],  # gate/up, down
            "roof_hbm_us": touched * per_expert / args.hbm * 1e6,
            "roof_flop_us": 2 * 3 * t * K * D * I / args.flops * 1e6,
        }
        if args.sweep:
            import deepinfer.kernels.moe_mxfp4 as mod

            mod.FAST_DECODE = False  # the portable decode as the reference of each variant's output
            ref = moe_mxfp4(*inputs[0], *mx, LIMIT)
            mod.FAST_DECODE = True
            orders = ("rotate",) if args.regs or args.rotate_only else ("plain", "shift", "rotate")
            for (cfg, swap), order in itertools.product(sweep_variants(t, args.regs), orders):
                key = f"{tuple(vars(cfg).values())} swap={swap} {order}"
                ws = sx.get(order, mx)
                try:
                    row[key] = time_graph(
                        lambda x, i, w, v=(cfg, swap, ws, order): run_variant(v[0], v[1], x, i, w, *v[2:]), inputs, 3
                    )
                except Exception as exc:  # a config the compiler rejects
                    row[key] = None
                    print(f"T={t} {key}: {type(exc).__name__}: {str(exc)[:200]}")
                    torch.cuda.synchronize()
                if row[key] is not None:
                    out = run_variant(cfg, swap, *inputs[0], ws, order)
                    row[key + " err"] = ((out - ref).norm() / ref.norm()).item()
                print(f"T={t} {key}: {row[key]} err {row.get(key + ' err')}", flush=True)
        else:
            times, outs = variants(inputs, mx, sx, args.reps, 2 if dev.type == "cuda" else 1)
            row.update({f"{name}_us": us for name, us in times.items()})
            row["mxfp4_us"] = times[DEFAULT]
            row["variants_bit_identical"] = all(torch.equal(outs[name], outs["plain"]) for name in UNSPLIT)
            unsplit = outs["rotate_tma"]
            row["split_max_rel_diff"] = max(
                ((outs[name] - unsplit).norm() / unsplit.norm()).item()
                for name in VARIANTS
                if name not in UNSPLIT and name != "rotate_wgmma"
            )
            row["wgmma_rel_diff"] = ((outs["rotate_wgmma"] - unsplit).norm() / unsplit.norm()).item()
            if deq is not None:
                out = moe_mxfp4(*inputs[0], *mx, LIMIT)
                ref = moe_triton(*inputs[0], *deq, LIMIT)
                row["rel_err_vs_triton"] = ((out - ref).norm() / ref.norm()).item()
                row["triton_bf16_us"] = time_graph(lambda x, i, w: moe_triton(x, i, w, *deq, LIMIT), inputs, args.reps)
                row["grouped_mm_bf16_us"] = time_graph(
                    lambda x, i, w: moe_grouped_mm(x, i, w, *deq, LIMIT), inputs, args.reps
                )
            row["mxfp4_TBps"] = touched * per_expert / row["mxfp4_us"] / 1e6
            row["roof_over_time"] = max(row["roof_hbm_us"], row["roof_flop_us"]) / row["mxfp4_us"]
        rows.append(row)
        del inputs
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{device_name(dev)}, Triton's interpreter"
    print(f"\n{name}, copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write), {per_expert / 1e6:.2f} MB per expert")
    if not args.sweep:
        head = f"| T | experts | mxfp4 µs ({', '.join(VARIANTS)}) | auto split | shift/rotate | split rel diff |"
        print(head + " TB/s | triton bf16 µs | grouped_mm bf16 µs | HBM roof µs | FLOP roof µs | roof/time |")
        print("|---" * 12 + "|")
        for r in rows:
            peers = [f"{r[c]:.1f}" if c in r else "-" for c in ("triton_bf16_us", "grouped_mm_bf16_us")]
            ab = ", ".join(f"{r[name + '_us']:.1f}" for name in VARIANTS)
            gain = r["split_auto_us"] / r["rotate_auto_us"]
            print(
                f"| {r['T']} | {r['experts_touched']:.1f} | {ab} | {r['auto_split']} | {gain:.2f} | "
                f"{r['split_max_rel_diff']:.1e} | {r['mxfp4_TBps']:.2f} | {peers[0]} | {peers[1]} | "
                f"{r['roof_hbm_us']:.1f} | {r['roof_flop_us']:.1f} | {r['roof_over_time']:.2f} |"
            )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
        path = args.out / f"moe_mxfp4-{'sweep-' if args.sweep else ''}{stamp}.json"
        meta = {
            "command": " ".join(sys.argv),
            "device": name,
            "copy_Bps": copy_bw,
            "bytes_per_expert": per_expert,
            "shape_D_I_E_k": [D, I, E, K],
        }
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
