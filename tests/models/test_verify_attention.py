"""A verify step's attention in one call per layer (``models/deepseek_v4/verify_attention.py``) against the sub-steps
it replaces, and the MTP block's observe pass (which runs it too) against the per-sequence path."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.backends.reference import ReferenceOps
from deepinfer.models.deepseek_v4 import verify_attention, verify_step
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.mtp_drafter import MTPDrafter
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from models.test_spec_verify import PAGE, PAGES, PARAMS, load, speculative_run

_SUB_STEPS: dict[str, list[torch.Tensor]] = {}  # the sub-steps' outputs, by checkpoint


@pytest.mark.parametrize("mutation", [None, "window rows not put in", "one write before the pool"])
def test_one_attention_call_attends_as_the_sub_steps(tiny_dirs: dict, mutation: str | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``verify_attention`` (every sub-step's rows in one call per layer) gives the sub-steps' verify outputs within
    rounding (the reference ops round a row with its lists' width, the widest sub-step's here) and the same tokens,
    through a run of verify steps whose groups complete inside them (ratios 4 and 16,
    1-7 drafts: both ways of a compressor ring are taken). Leaving the step's own rows out of the windows, or writing
    a ring's rows all before its pool, is caught."""
    model = load(tiny_dirs, "odd", ReferenceOps())
    modes, real = set(), verify_attention.ring_step

    def spy(plan, m, cap, ops):  # noqa: ANN001, ANN202
        rs = real(plan, m, cap, ops)
        modes.add("ext" if rs.old is not None else "split")
        if mutation == "one write before the pool" and rs.old is None:
            return verify_attention.RingStep(rs.cur, rs.prev, first=torch.maximum(rs.first, rs.then), then=rs.then)
        return rs

    monkeypatch.setattr(verify_attention, "ring_step", spy)
    if mutation == "window rows not put in":
        monkeypatch.setattr(verify_attention, "_window_rows", lambda s, k1, w, dev: (torch.zeros(0, dtype=torch.long,
                                                                                    device=dev),) * 2)  # fmt: skip
    outs: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    real_forward = verify_step.pooled_forward
    for fused in (True, False):
        if not fused and str(tiny_dirs["odd"]) in _SUB_STEPS:  # (the sub-steps' run: the same for every mutation)
            outs[False] = _SUB_STEPS[str(tiny_dirs["odd"])]
            continue
        model.verify_fused = fused
        monkeypatch.setattr(verify_step, "pooled_forward", lambda *a, f=fused: _keep(outs[f], real_forward(*a)))
        prompts = [[3, 4, 5, 6, 7, 8, 9], list(range(10, 21))]
        spec = speculative_run(model, prompts, [PARAMS[0]] * 2, [[], []], random.Random(7), 0.0)[0]
        outs[fused].append(torch.tensor([x for toks, _ in spec for x in toks]))
    _SUB_STEPS[str(tiny_dirs["odd"])] = outs[False]
    assert len(outs[True]) == len(outs[False]) > 5
    close = all((a.float() - b.float()).abs().max() <= 1e-4 for a, b in zip(outs[True], outs[False]))
    assert close == (mutation is None)
    assert modes == {"ext", "split"}


def _keep(into: list, got: tuple) -> tuple:
    into.append(got[0].clone())
    return got


@pytest.mark.parametrize("mutation", [None, "the window's pairs unbounded"])
def test_the_observe_pass_on_the_pool_observes_as_the_host_pass(tiny_dirs: dict, mutation: str | None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The MTP block's observe pass on the decode path (``draft_graphs.observe_loop``: one attention call over up to
    8 rows a sequence, more than the window of 6) gives the per-sequence path's heads and window rows within
    rounding. Pairing a row with the step's rows outside its window is caught."""
    if mutation:

        def unbounded(s: int, k1: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            j, b = torch.arange(k1).view(-1, 1, 1), torch.arange(s).view(1, -1, 1)
            i = torch.minimum(torch.arange(k1).view(1, 1, -1), j)
            dst = ((j * s + b) * w + w - 1 - (j - i)).reshape(-1)
            return dst.clamp_min(0).to(device), (i * s + b).reshape(-1).to(device)

        monkeypatch.setattr(verify_attention, "_window_rows", unbounded)
    prompts = [list(range(3, 11)), [40, 41, 42], list(range(50, 57))]
    got = []
    for on_pool in (True, False):
        model = load(tiny_dirs, "odd", ReferenceOps())
        model.verify_fused = True
        cache = PagedKVCache(model.config, PAGES * 3, PAGE)
        tables = [torch.arange(i * PAGES, (i + 1) * PAGES) for i in range(3)]
        states = [SequenceState() for _ in prompts]
        batch = ForwardBatch.build([SeqChunk(s, 0, len(x), t) for s, x, t in zip(states, prompts, tables)], prompts)
        h = model(batch, cache)
        drafter = MTPDrafter(model)
        monkeypatch.setattr(MTPDrafter, "_on_pool", lambda self, p=on_pool: p)
        heads = drafter.observe(h, batch.offsets(), [x[1:] + [5] for x in prompts], states, tables)
        layer = model.config.num_hidden_layers
        got.append((torch.stack([hd.logits for hd in heads]), [st.windows[layer].clone() for st in states]))
    (a, wa), (b, wb) = got
    close = bool((a - b).abs().max() <= 1e-4) and all(bool((x - y).abs().max() <= 1e-4) for x, y in zip(wa, wb))
    assert close == (mutation is None)
