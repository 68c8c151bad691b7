"""A census of the small torch kernels of DeepSeek-V4's graphed decode step, on the CPU.

The graphed step (``graphs.DecodeGraphs._segments``: embedding, ``Block.attn_in``, ``decode_step.attend``,
``Block.ffn_out`` per layer) runs a few hundred kernels on a GPU. The op set's methods (``ops.rms_norm``,
``ops.moe``, ...) are single Triton kernels there; everything else the model runs between them is torch glue, one
kernel per aten op. This script builds the tiny random V4 (bf16, like a GPU run), prefills a few sequences, then runs
decode steps through the step function a graph captures (eagerly, on the host, as ``tests/kernels/test_graphs.py``'s
``EagerSegments`` does) and records, under a ``TorchDispatchMode``, every aten op executed outside the op set's
public methods (a depth flag set by wrappers around them), attributed to the innermost stack frame inside
``libs/deepinfer/models/``. Ops that launch no kernel (views, ``empty``) are skipped.

    PYTHONPATH=libs:. .venv/bin/python bench/host/step_census.py [--batch 4] [--steps 3] [--ops reference|nvidia]
        [--libs DIR]

A second table counts the op set's (outermost) method calls per step: on a GPU each is at least one launch (most are
one Triton kernel; ``pointwise`` and a few others are torch kernels). ``--ops nvidia`` runs ``NvidiaOps`` (its Triton
kernels in the interpreter: set ``TRITON_INTERPRET=1``), which routes a few methods differently from ``ReferenceOps``;
the glue outside the methods is the same. ``--libs DIR``: the ``deepinfer`` sources to census (another checkout's
``libs``, for a before / after comparison).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import ROOT, add_common_args, result_header, write_json

MODELS = ""  # the models directory of the sources under census (use_libs)


def use_libs(libs: Path) -> None:
    """Census the ``deepinfer`` sources under ``libs``."""
    global MODELS
    if str(libs) not in sys.path:  # another checkout's sources first (a before / after comparison)
        sys.path.insert(0, str(libs))
    MODELS = str(libs.resolve() / "deepinfer" / "models") + os.sep


# aten ops that launch no kernel: views and allocations
NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
    "_reshape_alias", "view", "_unsafe_view", "reshape", "select", "slice", "expand", "unsqueeze", "squeeze",
    "as_strided", "t", "transpose", "permute", "unflatten", "flatten", "split", "split_with_sizes", "unbind",
    "chunk", "narrow", "diagonal", "view_as_real", "view_as_complex", "_to_copy_noop", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_local_scalar_dense",
}  # fmt: skip


class Census(TorchDispatchMode):
    """Counts the aten ops run while ``depth`` is 0 (outside the op set's methods), by model source line."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.on = False
        self.counts: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()  # the op set's outermost method calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and self.depth == 0:
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL and not func.is_view:
                self.counts[(_site(), name)] += 1
        return out


def _site() -> str:
    """The innermost stack frame inside ``libs/deepinfer/models/`` as ``file:line``."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(MODELS):
            return f"{frame.filename[len(MODELS) :]}:{frame.lineno}"
    return "?"


def wrap_ops(ops: object, census: Census) -> None:
    """Every public method of ``ops`` raises ``census.depth`` while it runs (the instance's attributes shadow the
    class's methods; methods calling each other nest)."""
    for name in dir(ops):
        if name.startswith("_"):
            continue
        fn = getattr(ops, name)
        if not callable(fn) or isinstance(fn, type):
            continue

        def wrapped(*a, _fn=fn, _name=name, **k):
            if census.on and census.depth == 0:
                census.calls[_name] += 1
            census.depth += 1
            try:
                return _fn(*a, **k)
            finally:
                census.depth -= 1

        setattr(ops, name, wrapped)


def build(kind: str, dtype: torch.dtype, device: str = "cpu", graphs: bool = False):
    from deepinfer.backends.reference import ReferenceOps
    from deepinfer.checkpoint.tiny import TINY_V4, random_weights
    from deepinfer.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer.models.deepseek_v4.family import FAMILY
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model

    if kind == "nvidia":
        from deepinfer.backends.nvidia import NvidiaOps

        ops = NvidiaOps(cuda_graphs=graphs)
    else:
        ops = ReferenceOps()
    config = DeepseekV4Config.from_dict({**TINY_V4, "num_nextn_predict_layers": 0})
    model = DeepseekV4Model(config, ops)
    model.step_graphs = FAMILY.step_graphs()  # as the engine's build: graphs where the op set allows them
    model.load_state_dict(random_weights(config, seed=0), strict=False)
    return model.to(device, dtype)


def on_gpu(batch: int, steps: int, dtype: torch.dtype, context: int = 200) -> tuple[int, float]:
    """On a GPU, ``NvidiaOps`` with CUDA graphs: the kernels of one graphed decode step (the profiler's kernel
    records of one forward: the graph's and the few outside it) and the mean time of ``steps`` forwards (CUDA
    events; the host's plan upload included)."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState

    dev = "cuda"
    model = build("nvidia", dtype, dev, graphs=True)
    gen = torch.Generator().manual_seed(0)
    vocab, pages = model.config.vocab_size, -(-(context + 16 + 2 * steps + 8) // 16)
    cache = PagedKVCache(model.config, pages * batch, 16, dtype=dtype, device=dev)
    states = [SequenceState() for _ in range(batch)]
    tables = [torch.arange(i * pages, (i + 1) * pages, device=dev) for i in range(batch)]
    model.ops.cuda_graphs = False
    for i, (st, table) in enumerate(zip(states, tables)):
        ids = torch.randint(2, vocab, (context - i,), generator=gen).tolist()
        model(ForwardBatch.build([SeqChunk(st, 0, context - i, table)], [ids], dev), cache)
    model.ops.cuda_graphs = True

    def step() -> None:
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        ids = [[int(torch.randint(2, vocab, (1,), generator=gen))] for _ in chunks]
        model(ForwardBatch.build(chunks, ids, dev), cache)

    for _ in range(4):  # capture, warm up
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                  and "Memset" not in e.name)  # fmt: skip
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return kernels, start.elapsed_time(end) * 1e3 / steps


def run(batch: int, steps: int, kind: str, dtype: torch.dtype, context: int = 30) -> Census:
    """The census of ``steps`` graphed-step functions at ``batch`` sequences (after one eager decode step that gives
    every state its pool slot); its counts are summed over the steps."""
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.graphs import DecodeGraphs
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState

    model = build(kind, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab, pages = model.config.vocab_size, -(-(context + 16 + steps) // 16)
    cache = PagedKVCache(model.config, pages * batch, 16, dtype=dtype)
    states, tables = [], []
    for i in range(batch):
        st, table = SequenceState(), torch.arange(i * pages, (i + 1) * pages)
        n = context - i
        model(ForwardBatch.build([SeqChunk(st, 0, n, table)], [torch.randint(2, vocab, (n,), generator=gen).tolist()]),
              cache)  # fmt: skip
        states.append(st)
        tables.append(table)

    def batch_of() -> ForwardBatch:
        chunks = [SeqChunk(s, s.num_tokens, 1, t) for s, t in zip(states, tables)]
        return ForwardBatch.build(chunks, [[int(torch.randint(2, vocab, (1,), generator=gen))] for _ in chunks])

    model(batch_of(), cache)  # an eager pooled step: every state adopted
    graphs = DecodeGraphs(model)
    census = Census()
    wrap_ops(model.ops, census)
    pool = model.state_pool
    with census:
        for _ in range(steps):
            b = batch_of()
            chunks = b.chunks
            slots = pool.adopt([c.state for c in chunks])
            span = max(c.start for c in chunks) + 1
            from deepinfer.models.deepseek_v4.decode_step import span_for

            bk = graphs._bucket(batch, torch.device("cpu"), span_for(span, cache.page_size), cache)
            bk.plan.fill(chunks, slots, b)
            (seg,) = graphs._segments(bk)
            pool.begin_step()
            census.on = True
            seg()  # what the graph captures
            census.on = False
            for c in chunks:
                c.state.num_tokens = c.end
            pool.end_step()
    return census


def calls_table(calls: collections.Counter, steps: int) -> str:
    lines = ["| op-set method | calls per step |", "|---|---|"]
    lines += [f"| {name} | {n // steps} |" for name, n in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))]
    lines.append(f"| **total** | **{sum(calls.values()) // steps}** |")
    return "\n".join(lines)


def table(counts: collections.Counter, steps: int) -> str:
    by_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (site, op), n in counts.items():
        by_site[site][op] += n
    rows = sorted(by_site.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    lines = ["| site | ops | per step |", "|---|---|---|"]
    for site, ops in rows:
        names = ", ".join(f"{op}×{n // steps}" if n // steps > 1 else op for op, n in ops.most_common())
        lines.append(f"| {site} | {names} | {sum(ops.values()) // steps} |")
    total = sum(counts.values()) // steps
    lines.append(f"| **total** | | **{total}** |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ops", choices=("reference", "nvidia"), default="reference")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--libs", type=Path, default=ROOT / "libs")
    ap.add_argument("--cuda", action="store_true", help="on a GPU: kernels per graphed step and its time")
    add_common_args(ap)
    a = ap.parse_args()
    a.cuda = a.cuda or a.device == "cuda"
    if a.tiny:
        a.batch, a.steps = 2, 1
    use_libs(a.libs)
    torch.manual_seed(0)
    if a.cuda:
        kernels, us = on_gpu(a.batch, max(a.steps, 20), getattr(torch, a.dtype))
        print(f"GPU, NvidiaOps, CUDA graphs, batch {a.batch}, {a.dtype}: {kernels} kernels per decode step, "
              f"{us:.1f} µs per step (forward, host included)")  # fmt: skip
        return
    census = run(a.batch, a.steps, a.ops, getattr(torch, a.dtype))
    print(f"# graphed decode step: batch {a.batch}, {a.ops} ops, {a.dtype}, {a.steps} steps (counts per step)\n")
    print("torch kernels outside the op set's methods:\n")
    print(table(census.counts, a.steps))
    print("\nop-set method calls:\n")
    print(calls_table(census.calls, a.steps))
    glue, calls = sum(census.counts.values()) // a.steps, sum(census.calls.values()) // a.steps
    print(f"\nper step: {glue} glue kernels + {calls} op-set calls = {glue + calls}")
    if a.out:
        res = {**result_header("cpu", a), "glue_kernels_per_step": glue, "op_calls_per_step": calls,
               "glue": {str(k): v for k, v in census.counts.items()}, "calls": dict(census.calls)}  # fmt: skip
        write_json(a.out / f"{res['date']}-step-census.json", res)


if __name__ == "__main__":
    main()
