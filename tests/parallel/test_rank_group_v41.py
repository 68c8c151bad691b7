"""DeepSeek-V4.1 on a worker of four ranks in real processes (``LLM(ep=4)``; the V4 engine on two ranks, with
preemptions and EPLB: ``test_rank_group.py``): with the batch-invariant ops the outputs are, request by request,
the single-process engine's, over chunked prefill, steps mixing prefill and decode, a prefix-cache hit, greedy and
seeded sampling, ranks idling through steps, and an image prompt (placed on rank 0, where its features are)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from deepinfer import LLM, SamplingParams
from deepinfer.runtime import shared_host

SHARED = list(range(40, 76))


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (50, 70, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()


def prompts(image_token: int) -> tuple[list[dict], list[SamplingParams]]:
    out = [
        {"prompt_token_ids": SHARED + [5, 6]},
        {"prompt_token_ids": [0, 17, 4242, image_token, 99, 5, 6, 7], "multi_modal_data": {"image": [png(1)]}},
        {"prompt_token_ids": SHARED + [5, 6, 7, 8]},  # resumes from r0's prompt
        {"prompt_token_ids": [9, 8, 7]},
    ]
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    params = [greedy if i % 2 == 0 else SamplingParams(temperature=0.8, seed=70 + i, max_tokens=4, logprobs=1)
              for i in range(len(out))]  # fmt: skip
    return out, params


def outputs(llm: LLM) -> list[tuple]:
    ps, params = prompts(llm.config.image_token_id)
    first = llm.generate(ps[:1], params[:1])
    rest = llm.generate(ps[1:], params[1:])
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens) for o in first + rest]


@pytest.mark.timeout(600)
def test_four_ranks_of_v41_give_one_process_outputs(tiny_v41_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Engram tables in host memory (``DEEPINFER_ENGRAM_TABLES=host``): once for the host, in memory every
    rank maps (``runtime.shared_host``), filled by rank 0; no file of theirs is left in ``/dev/shm``."""
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "host")
    kw = dict(model=tiny_v41_dir, dtype="float32", page_size=16, num_pages=64, batch_invariant=True,
              quant_sim=False, max_num_batched_tokens=16)  # fmt: skip
    want = outputs(LLM(**kw))
    with LLM(ep=4, **kw) as llm:
        got = outputs(llm)
        tables = [b.engram.embed.weight for b in llm.model.layers if b.engram is not None]
        maps = [open(f"/proc/{p.pid}/maps").read() for p in llm._ranks.procs]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert got[2][2] > 0, "r2 resumed from r0's resume point"
    paths = {shared_host.mapping_of(t) for t in tables}
    assert tables and None not in paths and len(paths) == len(tables)
    for m in maps:  # every other rank maps the same files
        assert paths <= {ln.split()[5] for ln in m.splitlines() if "/dev/shm/deepinfer-" in ln}
    assert not [p for p in paths if os.path.exists(p)]  # removed once every rank mapped them


@pytest.mark.timeout(600)
def test_a_context_parallel_v41_worker_gives_one_process_outputs(tiny_v41_dir) -> None:
    """``LLM(cp=2)`` on V4.1 (each prefill step's tokens split between two ranks, Engram and every CSA2 layer kind):
    the text prompts' tokens and logprobs are the single process's; an image prompt is refused (rank 0 alone would
    hold its features)."""
    kw = dict(model=tiny_v41_dir, dtype="float32", page_size=16, num_pages=64, batch_invariant=True,
              quant_sim=False, max_num_batched_tokens=16)  # fmt: skip
    ps, params = prompts(0)
    text = [0, 2, 3]
    one = LLM(**kw)
    want = one.generate([ps[i] for i in text], [params[i] for i in text])
    with LLM(cp=2, **kw) as llm:
        got = llm.generate([ps[i] for i in text], [params[i] for i in text])
        split = llm.model.cp.steps
        image, image_params = prompts(llm.config.image_token_id)
        with pytest.raises(ValueError, match="images are not served"):
            llm.generate([image[1]], [image_params[1]])
    assert split >= 2
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in want]  # fmt: skip
