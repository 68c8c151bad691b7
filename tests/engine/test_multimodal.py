"""The engine's model-agnostic image plumbing (``engine.multimodal``, the scheduler): prefix-cache keys that fold in
each image's digest, images sent with the chunks that cover their spans, no bounded decoder replay for image
prompts, and the checks of a :class:`MultiModalInput`. No model: the scheduler never reads the family's payload."""

from __future__ import annotations

import pytest

from deepinfer.engine.multimodal import MultiModalInput, content_digest
from deepinfer.engine.pages import PagePool
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.sampling_params import SamplingParams

IMG = 9  # the placeholder id every span position carries
PROMPT = [5, 6, 7] + [IMG] * 10 + [8, 9, 10, 11, 12, 13, 14]  # span [3, 13)
PARAMS = SamplingParams(temperature=0, max_tokens=1)


def mm(image: bytes, payload: object = None) -> MultiModalInput:
    return MultiModalInput(((3, 13),), (content_digest(image),), payload)


def test_cache_tokens_fold_in_the_digest() -> None:
    a, b = mm(b"image a").cache_tokens(PROMPT), mm(b"image b").cache_tokens(PROMPT)
    assert a[:3] == b[:3] == PROMPT[:3] and a[13:] == b[13:] == PROMPT[13:]  # text positions keep their ids
    assert all(t < -1 for t in a[3:13]) and all(x != y for x, y in zip(a[3:13], b[3:13]))
    assert len(set(a[3:7])) == 4 and a[3:7] == a[7:11]  # the four 62-bit words of the digest, cycled
    assert mm(b"image a").cache_tokens(PROMPT) == a  # the same bytes: the same keys


def run(sched: Scheduler, rid: str) -> list:
    """Schedule until ``rid`` samples its token; feed the token back (it finishes: max_tokens=1)."""
    from deepinfer.engine.interfaces import SeqResult, StepResult

    chunks = []
    while True:
        plan = sched.schedule()
        chunks += [c for c in plan.chunks if c.request_id == rid]
        done = [c for c in plan.chunks if c.sample]
        if done:
            sched.update(StepResult(plan.step_id, [SeqResult(c.request_id, token_id=20) for c in done]))
            sched.pop_finished(rid)
            return chunks


def test_the_prefix_cache_never_shares_across_images() -> None:
    config = SchedulerConfig(page_size=4, max_model_len=256, eos_token_id=1, max_num_batched_tokens=6)
    sched = Scheduler(config, PagePool(64))
    sched.add("a", PROMPT, PARAMS, mm=mm(b"image a", "payload-a"))
    chunks = run(sched, "a")
    # chunks of 6 cut the span; each chunk covering part of it carries the images, the others none
    assert [(c.start, len(c.token_ids)) for c in chunks] == [(0, 6), (6, 6), (12, 6), (18, 2)]
    assert [c.mm is not None for c in chunks] == [True, True, True, False]
    assert chunks[0].mm.data == "payload-a"
    follow = PROMPT + [20, 30, 31]
    sched.add("b", follow, PARAMS, mm=mm(b"image b"))
    first = sched.schedule().chunks[0]
    assert first.request_id == "b" and first.start == 0 and first.resume_from is None  # nothing past the span start
    assert sched.requests["b"].cache_miss_reason == "no_resume_point"
    sched.abort(["b"])
    sched.pop_finished("b")
    sched.schedule()
    sched.add("c", follow, PARAMS, mm=mm(b"image a"))
    first = sched.schedule().chunks[0]
    assert first.request_id == "c" and first.start >= len(PROMPT) and first.resume_from is not None
    # without images the same tokens would have resumed from "a"'s state: the keys, not the ids, kept them apart
    plain = Scheduler(config, PagePool(64))
    plain.add("a", PROMPT, PARAMS)
    run(plain, "a")
    plain.add("b", follow, PARAMS)
    assert plain.schedule().chunks[0].resume_from is not None


def test_no_bounded_decoder_replay_for_image_prompts() -> None:
    config = SchedulerConfig(page_size=4, max_model_len=256, eos_token_id=1, decoder_replay=4)
    sched = Scheduler(config, PagePool(64))
    sched.add("img", PROMPT, PARAMS, mm=mm(b"x"))
    sched.add("text", PROMPT, PARAMS)
    got = {c.request_id: c.decoder_from for c in sched.schedule().chunks}
    assert got == {"img": None, "text": len(PROMPT) - 4}


def test_bad_multimodal_input_is_refused() -> None:
    d = content_digest(b"x")
    with pytest.raises(ValueError, match="multi_modal: 2 span"):
        MultiModalInput(((0, 2), (3, 4)), (d,), None)
    with pytest.raises(ValueError, match="multi_modal.spans: ascending, disjoint"):
        MultiModalInput(((3, 5), (4, 6)), (d, d), None)
    with pytest.raises(ValueError, match="multi_modal.digests: 32-byte"):
        MultiModalInput(((0, 2),), (b"short",), None)
    sched = Scheduler(SchedulerConfig(page_size=4, max_model_len=256, eos_token_id=1), PagePool(64))
    with pytest.raises(ValueError, match="multi_modal.spans: a span ends at 13, past the prompt's 5 tokens"):
        sched.add("r", PROMPT[:5], PARAMS, mm=mm(b"x"))


def test_positions_of_the_prompt_as_sent_move_past_the_spans() -> None:
    """Resume hints name positions of the prompt with one placeholder per image; each placeholder became its span."""
    two = MultiModalInput(((2, 7), (9, 12)), (content_digest(b"a"), content_digest(b"b")), None)
    # as sent: t t P t P t  ->  expanded: t t [2, 7) t [9, 12) t
    assert two.expand_positions([0, 1, 2, 3, 4, 5, 6]) == [0, 1, 2, 7, 8, 9, 12]
    assert mm(b"a").expand_positions([3, 4, len(PROMPT) - 9]) == [3, 13, len(PROMPT)]


def test_feature_cache_and_budget() -> None:
    """The cache answers an image it holds without the encoder, by its bytes, least recently used out first; the
    budget refuses what does not fit beside the features held (Overloaded) and what never fits (ValueError)."""
    import torch

    from deepinfer.engine.image_cache import FeatureBudget, FeatureCache, nbytes
    from deepinfer.serving.errors import Overloaded

    class Tower:
        calls = 0

        def encode(self, image: bytes) -> torch.Tensor:
            self.calls += 1
            return torch.full((len(image), 4), float(image[0]))  # 16 bytes per input byte

    tower = Tower()
    cache = FeatureCache(tower, capacity_bytes=100)
    a = cache.encode(b"aa")
    assert cache.encode(b"aa") is a and (tower.calls, cache.hits, cache.bytes) == (1, 1, 32)
    cache.encode(b"bbb")
    cache.encode(b"aa")  # a is the most recent now
    cache.encode(b"cc")  # 32 + 48 + 32 > 100: b goes
    assert (tower.calls, cache.bytes, len(cache)) == (3, 64, 2)
    cache.encode(b"bbb")
    assert tower.calls == 4
    cache.encode(b"x" * 10)  # larger than the whole cache: encoded, not kept
    assert cache.bytes <= 100 and cache.encoded == 5
    budget = FeatureBudget(limit=100)
    assert budget.take("r1", a) == nbytes(a) == 32
    budget.take("r2", torch.zeros(12))
    with pytest.raises(Overloaded, match="DEEPINFER_IMAGE_FEATURE_BUDGET_BYTES"):
        budget.take("r3", torch.zeros(12))
    with pytest.raises(ValueError, match="^images: "):
        budget.take("r4", torch.zeros(26))
    budget.release("r2")
    budget.take("r3", torch.zeros(12))
    assert budget.total == 80
