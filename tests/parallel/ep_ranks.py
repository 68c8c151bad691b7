"""What each rank of the expert-parallel tests runs (``test_expert_parallel.py``), in its own process: a gloo group
on loopback, a tiny V4 or V4.1 model built by its family with its MoE layers sharded, its own sequences (attention
data-parallel) driven by ``drive``; it writes what it computed to a safetensors file (tensors only across the
process boundary)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from deepinfer.backends.reference import BatchInvariantOps, ReferenceOps
from deepinfer.engine.models import family_of, parse_config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.graphs import DecodeGraphs
from deepinfer.parallel import rebalancer
from deepinfer.parallel.all_to_all import TorchAllToAll
from deepinfer.parallel.eplb import rebalance
from deepinfer.parallel.expert_parallel import ExpertParallel, FixedBuffers
from deepinfer.parallel.launch import rank_groups
from deepinfer.parallel.layout import Layout
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.quant.native import EXPERT_WEIGHTS, REFS_ATTR, expert_modules, expert_order, order_experts

PAGE, PAGES, CHUNK = 16, 6, 8
PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(n)] for i, n in enumerate((13, 7, 20, 5, 9, 16, 3, 11))]
STEPS = 6


class ArrangingOps(BatchInvariantOps):
    """An op set that keeps the checkpoint's formats and, once they are loaded, derives from the MXFP4 experts what
    the NVIDIA op set derives on a GPU: codes rearranged for its kernels (the rotate order) and per-row data read
    from the weights (here each row's largest scale, where W4A8 keeps its row references). EPLB must move rows of
    the stored format and derive both again (``rebalancer.apply``)."""

    native_weights = True

    def prepare_weights(self, model: torch.nn.Module) -> None:
        order_experts(model, "rotate")
        for _, m in expert_modules(model):
            if getattr(m, REFS_ATTR, None) is None:
                setattr(m, REFS_ATTR, row_data(m))


class HostReplays:
    """Stands in for CUDA graphs on the host (mixed into a family's decode graphs: ``host_replays``), with their
    collective traits: a capture runs its segments twice, as ``SegmentGraphs._capture``'s warm-up does (their
    exchanges with it); a replay runs them once and leaves no Python count behind (a graph runs no Python:
    ``ExpertParallel.calls`` stays as it was)."""

    def applies(self, batch: ForwardBatch) -> bool:
        return bool(batch.chunks) and all(c.length == 1 for c in batch.chunks)

    def _capture(self, size: int, device: torch.device, extra: tuple = (), before: Callable | None = None) -> object:
        self.captures += 1
        bk = self._bucket(size, device, *extra)
        if before is not None:
            before(bk)
        segs = self._segments(bk)
        for _ in range(2):
            for seg in segs:
                seg()
        bk.graphs = [_Replay(seg, self.model) for seg in segs]
        return bk


def host_replays(model: torch.nn.Module) -> DecodeGraphs:
    """``HostReplays`` over ``model``'s family's decode graphs (V4's or V4.1's)."""
    from deepinfer.models.deepseek_v41.graphs import DecodeGraphs as V41DecodeGraphs

    base = V41DecodeGraphs if type(model).__module__.startswith("deepinfer.models.deepseek_v41") else DecodeGraphs
    return type("HostReplays", (HostReplays, base), {})(model, max_batch=8)


class _Replay:
    def __init__(self, seg: Callable[[], None], model: torch.nn.Module) -> None:
        self.seg, self.model = seg, model

    def replay(self) -> None:
        eps = [layer.ffn.ep for layer in self.model.layers]
        calls = [ep.calls for ep in eps]
        self.seg()
        for ep, n in zip(eps, calls):
            ep.calls = n


def graphs_warm_up(model: torch.nn.Module, cache: object, sizes: tuple[int, ...], page: int) -> None:
    """What every rank runs alike before serving (``engine.warmup``): a decode step of each size in ``sizes`` on
    throwaway sequences (pages from ``page`` on), capturing its bucket while the model's ``replay_gate`` lets it."""
    gate = model.replay_gate
    gate.capturing = True
    for n in sizes:
        chunks = [SeqChunk(family_of(model.config).new_state(), 0, 1, torch.tensor([page + i])) for i in range(n)]
        model(ForwardBatch.build(chunks, [[5]] * n), cache)
    gate.capturing = False


def decide(model: torch.nn.Module, tokens: int) -> None:
    """The step's form, as a rank group's rank 0 decides it from every rank's plan (``rank_group.step_form``): the
    most tokens any rank has, within the fixed buffers (an all-reduce here, before the forward)."""
    fixed = model.layers[0].ffn.ep.fixed
    most = torch.tensor([max(tokens, 1)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    fixed.decided = int(most) <= fixed.tokens


def row_data(m: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(m, f"{w}_scale").amax(-1) for w in EXPERT_WEIGHTS)


def arranged_now(m: torch.nn.Module) -> bool:
    """Whether ``m``'s codes are rearranged and its per-row data is that of the weights it holds now."""
    got = getattr(m, REFS_ATTR, None)
    return expert_order(m) == "rotate" and got is not None and all(map(torch.equal, got, row_data(m)))


def load(ckpt: Path, invariant: bool, ep: ExpertParallel | None = None, arranged: bool = False) -> torch.nn.Module:
    """The model at ``ckpt`` as a worker builds it (``ModelFamily.build``, fp32, no quantisation simulation), its MoE
    layers holding ``ep``'s experts only where given; ``arranged``: with ``ArrangingOps``."""
    config = parse_config(json.loads((ckpt / "config.json").read_text()))
    ops = ArrangingOps() if arranged else BatchInvariantOps() if invariant else ReferenceOps()
    return family_of(config).build(ckpt, config, ops, torch.float32, torch.device("cpu"), False, ep=ep)


def n_experts(ckpt: Path) -> int:
    raw = json.loads((ckpt / "config.json").read_text())
    return raw.get("text_config", raw)["n_routed_experts"]


@torch.no_grad()
def drive(model: torch.nn.Module, seqs: list[int], between: Callable[[int], None] | None = None,
          graphs: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:  # fmt: skip
    """``STEPS`` steps over the sequences ``seqs`` (of ``PROMPTS``): each consumes its prompt ``CHUNK`` tokens a step
    (chunked prefill), then decodes its greedy tokens; a step mixes both. Returns each sequence's last logits of
    each step it took part in, by ``"seq/step"``. ``between(step)`` runs after each step. ``graphs``: the decode
    buckets captured first (``graphs_warm_up``; the model's ``decode_graphs`` set), each step's form decided."""
    family = family_of(model.config)
    cache = family.new_cache(model.config, PAGES * len(PROMPTS) + max(graphs, default=0), PAGE, torch.float32, "cpu")
    if graphs:
        graphs_warm_up(model, cache, graphs, PAGES * len(PROMPTS))
    states = {i: family.new_state() for i in seqs}
    tables = {i: torch.arange(i * PAGES, (i + 1) * PAGES) for i in seqs}
    toks = {i: list(PROMPTS[i]) for i in seqs}
    out = {}
    for step in range(STEPS):
        chunks, ids, who = [], [], []
        for i in seqs:
            st = states[i]
            n = min(CHUNK, len(toks[i]) - st.num_tokens)
            if n <= 0:
                continue
            chunks.append(SeqChunk(st, st.num_tokens, n, tables[i]))
            ids.append(toks[i][st.num_tokens : st.num_tokens + n])
            who.append(i)
        batch = ForwardBatch.build(chunks, ids)
        if graphs:
            decide(model, batch.num_tokens)
        h = model(batch, cache)
        logits = model.logits(h)[[b - 1 for _, b in batch.offsets()]]
        for i, c, row in zip(who, chunks, logits):
            out[f"{i}/{step}"] = row.clone()
            if c.end == len(toks[i]):  # the prompt (or the last token) consumed: its next token
                toks[i].append(int(row.argmax()))
        if between is not None:
            between(step)
    return out


def rebalance_after(model: torch.nn.Module, step: int, at: int, out: dict[str, torch.Tensor]) -> None:
    """EPLB between steps ``at`` and ``at + 1``: every layer's loads summed over the ranks, a placement with one
    redundant slot per rank, the experts moved; what each layer holds now, and its weights, into ``out``."""
    if step != at:
        return
    world, loads, new = dist.get_world_size(), rebalancer.taken_loads(model), {}
    for i, layer in enumerate(model.layers):
        load = torch.tensor(loads[i])
        dist.all_reduce(load)
        out[f"load/{i}"] = load
        new[i] = rebalance(load.numpy(), world, -(-layer.ffn.ep.placement.n_experts // world) + 1)
    before = [_storage(layer.ffn) for layer in model.layers]
    rebalancer.apply(model, new)
    for i, layer in enumerate(model.layers):
        out[f"kept/{i}"] = torch.tensor([_storage(layer.ffn) == before[i]])  # every tensor where it was
        out[f"held/{i}"] = torch.tensor(layer.ffn.ep.held)
        out[f"w1/{i}"], out[f"w2/{i}"] = layer.ffn.w1.clone(), layer.ffn.w2.clone()
        out[f"arranged/{i}"] = torch.tensor([arranged_now(layer.ffn)])


def _storage(m: torch.nn.Module) -> list[int]:
    """Where a sharded MoE layer's expert weights, routing tables and derived row data are (what graphs hold)."""
    refs = getattr(m, REFS_ATTR, None) or ()
    tensors = [getattr(m, f"{w}{s}", None) for w in EXPERT_WEIGHTS for s in ("", "_scale")]
    return [t.data_ptr() for t in [*tensors, *m.ep.tables, *refs] if t is not None]


def main() -> None:
    rank, world, port, ckpt, out, invariant, mode = sys.argv[1:8]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if mode == "check":  # each rank given its own DEEPINFER_EP_FIXED_BUFFER_TOKENS: refused on every rank
            try:
                FixedBuffers(4 + rank).check()
            except RuntimeError as e:
                save_file({"refused": torch.tensor(list(str(e).encode()))}, str(Path(out) / f"rank{rank}.safetensors"))
            return
        n = int(mode[2:]) if mode[:2] in ("tp", "cp") else 1  # "tp2" / "cp2": tensor- / context-parallel groups
        layout = Layout(world, n if mode.startswith("tp") else 1, n if mode.startswith("cp") else 1)
        e = n_experts(Path(ckpt))  # "eplb-arranged": EPLB's slot count from the start (its moves keep every tensor)
        placement = ExpertPlacement.even(e, world, -(-e // world) + 1 if mode == "eplb-arranged" else 0)
        tp, cp = rank_groups(layout)
        graphed = mode.startswith("graphs")  # "graphs4": fixed buffers of 4 tokens, decode graphs of bucket 4
        tokens = int(mode[5:]) if mode.startswith("fixed") else int(mode[6:]) if graphed else 0  # "fixed14": 14
        fixed = FixedBuffers(tokens) if tokens else None
        ep = ExpertParallel(placement, TorchAllToAll(), tp, fixed)
        ep.cp = cp
        model = load(Path(ckpt), invariant == "1", ep, arranged=mode == "eplb-arranged")
        if graphed:
            model.ops.cuda_graphs, model.decode_graphs = True, host_replays(model)
        moved: dict[str, torch.Tensor] = {}
        hook = None if not mode.startswith("eplb") else lambda step: rebalance_after(model, step, 2, moved)
        mine = [i for i in range(len(PROMPTS)) if i % layout.dp == layout.group_of(rank)]
        got = drive(model, mine, hook, graphs=(4,) if graphed else ())
        got.update(moved)
        if graphed:  # decode steps replayed, buckets captured (every one in the warm-up)
            got["graphs"] = torch.tensor([model.decode_graphs.replays, model.decode_graphs.captures])
        if cp is not None:
            got["cp/steps"] = torch.tensor([cp.steps])  # steps split over the group
        if fixed is not None:
            got["fixed/steps"] = torch.tensor([fixed.steps])  # steps whose exchanges took the fixed buffers
        save_file(got, str(Path(out) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
