"""``LLM`` end to end on a tiny random DeepSeek-V4 checkpoint (fp32, CPU).

Greedy outputs must not depend on batching, chunked prefill or preemption; seeded sampling must be
reproducible; logprobs follow vLLM's shapes and match a direct forward; stop rules and input validation
behave as documented, and a refused request never disturbs the ones being served.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.chat import encode_messages
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState

MAX_TOKENS = 30
VOCAB = 129280
_ids = torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
PROMPTS = [
    "Hi",
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog.",
    {"prompt_token_ids": [0, 17, 4242, 99, 5, 6, 7]},
    "def add(a, b):\n    return a + b\n",
    {"prompt_token_ids": _ids},
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llm") / "m", seed=0)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=128, page_size=16)


@pytest.fixture(scope="module")
def tight(model_dir) -> LLM:
    """A page pool that holds about two of the sequences below, and a 16-token step budget."""
    return LLM(model=model_dir, dtype="float32", num_pages=14, page_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def short(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_pages=32, page_size=8, max_model_len=64)


@pytest.fixture(scope="module")
def reference(llm: LLM):
    """Greedy outputs of PROMPTS, all in one batch, on the roomy engine."""
    return llm.generate(PROMPTS, GREEDY)


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def forward_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of ``ids``, from a fresh cache and state."""
    ps = llm.engine.scheduler.config.page_size
    n_pages = math.ceil(len(ids) / ps)
    cache = PagedKVCache(llm.config, n_pages, ps, llm.dtype)
    batch = ForwardBatch.build([SeqChunk(SequenceState(), 0, len(ids), torch.arange(n_pages))], [ids])
    with torch.no_grad():
        return torch.log_softmax(llm.model.logits(llm.model(batch, cache)).float(), -1)


# -- batching, chunking, preemption ------------------------------------------------------------------


def test_batch_equals_one_at_a_time(llm: LLM, reference):
    assert len({len(o.prompt_token_ids) for o in reference}) == len(PROMPTS)  # all lengths differ
    for p, ref in zip(PROMPTS, reference):
        (alone,) = llm.generate(p, GREEDY)
        assert alone.prompt_token_ids == ref.prompt_token_ids
        assert tokens(alone) == tokens(ref)
        assert len(tokens(ref)) == MAX_TOKENS or ref.outputs[0].finish_reason == "stop"
        assert alone.outputs[0].text == ref.outputs[0].text
    sched = llm.engine.scheduler
    assert sched.pages.num_used == sched.num_cached_pages > 0  # only resume points hold pages
    llm.reset_prefix_cache()
    assert sched.pages.num_used == 0


def test_preemption_and_chunked_prefill_give_the_same_tokens(tight: LLM, reference):
    outs = tight.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs), [o.num_preemptions for o in outs]
    assert tight.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, reference):
        assert tokens(out) == tokens(ref)
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        # prompt logprobs, scored over several chunks and recomputations: each position exactly once
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(out.prompt_token_ids)
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4
    sched = tight.engine.scheduler
    tight.reset_prefix_cache()
    assert sched.pages.num_used == 0 and sched.pages.num_free == sched.pages.num_total
    assert not sched.has_unfinished() and not sched.requests


# -- seeded sampling ---------------------------------------------------------------------------------


def sampled(seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=seed, **kw)


def test_seeded_sampling_is_reproducible(llm: LLM):
    p = "Once upon a time"
    (a,) = llm.generate(p, sampled(7))
    (b,) = llm.generate(p, sampled(7))
    assert tokens(a) == tokens(b) and len(tokens(a)) == 8
    (c,) = llm.generate(p, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seq_seed=7))
    assert tokens(c) == tokens(a)
    # batched with unseeded and greedy neighbours, before and after it in the batch
    outs = llm.generate(["Hi", p, "The quick brown fox"], [sampled(), sampled(7), SamplingParams(temperature=0)])
    assert tokens(outs[1]) == tokens(a)
    # different seeds give different samples
    others = [tokens(llm.generate(p, sampled(s))[0]) for s in (1, 2, 3)]
    assert all(o != tokens(a) for o in others) and len({tuple(o) for o in others}) == 3


def test_unseeded_sampling_runs(llm: LLM):
    outs = llm.generate(PROMPTS[:3], sampled())
    for o in outs:
        assert o.finished and 1 <= len(tokens(o)) <= 8
        assert o.outputs[0].finish_reason in ("length", "stop")
        assert all(0 <= t < VOCAB for t in tokens(o))


def test_seeded_sampling_survives_preemption(llm: LLM, tight: LLM):
    params = [sampled(100 + i) for i in range(len(PROMPTS))]
    roomy = llm.generate(PROMPTS, params)
    cramped = tight.generate(PROMPTS, params)
    assert [tokens(o) for o in cramped] == [tokens(o) for o in roomy]


# -- logprobs ----------------------------------------------------------------------------------------


def test_logprobs_follow_vllm_shapes_and_match_a_forward(llm: LLM):
    prompt = "The quick brown fox jumps over the lazy dog."
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2))
    ids, gen = out.prompt_token_ids, tokens(out)
    plp = out.prompt_logprobs
    assert isinstance(plp, list) and len(plp) == len(ids) and plp[0] is None
    ref = forward_logprobs(llm, ids + gen[:-1])
    for i in range(1, len(ids)):
        entry = plp[i]
        assert isinstance(entry, dict) and ids[i] in entry and 2 <= len(entry) <= 3
        assert next(iter(entry)) == ids[i]  # the actual token comes first
        top2 = torch.topk(ref[i - 1], 2).indices.tolist()
        assert set(top2) <= entry.keys()
        for t, lp in entry.items():
            assert abs(lp - ref[i - 1, t].item()) <= 1e-4
    lps = out.outputs[0].logprobs
    assert isinstance(lps, list) and len(lps) == len(gen) == 5
    for k, (t, entry) in enumerate(zip(gen, lps)):
        assert t in entry and len(entry) == 3  # greedy: the chosen token is the top-1
        assert entry[t] == max(entry.values())
        row = ref[len(ids) - 1 + k]
        assert set(torch.topk(row, 3).indices.tolist()) == entry.keys()
        for tok, lp in entry.items():
            assert abs(lp - row[tok].item()) <= 1e-4
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(gen, lps)), abs=1e-5)


def test_logprobs_zero_and_off(llm: LLM):
    (out,) = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3, logprobs=0, prompt_logprobs=0))
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in tokens(out)]
    assert out.prompt_logprobs[0] is None
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]
    (out,) = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


# -- stop rules, prompt forms, chat ------------------------------------------------------------------


def pick_stop(text: str) -> tuple[str, int]:
    """A 3-letter ASCII stop string from the middle of ``text`` that occurs once, and where it is."""
    for k in range(4, len(text) - 3):
        s = text[k : k + 3]
        if s.isascii() and s.isalpha() and text.count(s) == 1:
            return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(llm: LLM, reference):
    i = max(range(len(PROMPTS)), key=lambda j: sum(c.isascii() and c.isalpha() for c in reference[j].outputs[0].text))
    ref = reference[i].outputs[0]
    s, at = pick_stop(ref.text)
    (out,) = llm.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[s]))
    o = out.outputs[0]
    assert o.text == ref.text[:at] and o.finish_reason == "stop" and o.stop_reason == s
    assert o.token_ids == ref.token_ids[: len(o.token_ids)] and len(o.token_ids) < len(ref.token_ids)
    kept = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["zzzzqqq", s], include_stop_str_in_output=True)
    (out,) = llm.generate(PROMPTS[i], kept)
    o2 = out.outputs[0]
    assert o2.text == ref.text[: at + len(s)] and o2.stop_reason == s and o2.token_ids == o.token_ids
    # the stop string completes on the last allowed token: "stop" wins over "length" (as in vLLM)
    k = len(o.token_ids)
    (out,) = llm.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=k, stop=[s]))
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (ref.text[:at], "stop", s)
    # before min_tokens are out a stop string is ignored, and the text stays whole
    (out,) = llm.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[s], min_tokens=k + 1))
    o3 = out.outputs[0]
    assert (o3.token_ids, o3.text) == (ref.token_ids, ref.text)
    assert o3.finish_reason == "length" and o3.stop_reason is None


def test_stop_token_ids(llm: LLM, reference):
    ref = tokens(reference[1])
    t = ref[4]
    (out,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[t]))
    assert tokens(out) == ref[: ref.index(t) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == t


def test_ignore_eos_gives_exactly_max_tokens(llm: LLM):
    (out,) = llm.generate("Hi", SamplingParams(temperature=0.8, seed=1, max_tokens=7, ignore_eos=True))
    assert len(tokens(out)) == 7 and out.outputs[0].finish_reason == "length"
    assert out.usage == {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": 7,
        "total_tokens": len(out.prompt_token_ids) + 7,
        "cached_tokens": out.num_cached_tokens,
    }


def test_token_id_prompts_equal_text_prompts(llm: LLM, reference):
    ids = reference[2].prompt_token_ids
    (out,) = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.prompt is None and reference[2].prompt == PROMPTS[2]
    assert out.prompt_token_ids == ids and tokens(out) == tokens(reference[2])
    (out,) = llm.generate({"prompt": PROMPTS[2]}, GREEDY)
    assert tokens(out) == tokens(reference[2])


def test_chat_renders_the_chat_encoding(llm: LLM):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    (out,) = llm.chat(msgs, params)
    text = encode_messages(msgs)
    assert out.prompt == text
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False).ids
    assert out.prompt_token_ids[0] == llm.config.bos_token_id
    (plain,) = llm.generate(text, params)
    assert tokens(out) == tokens(plain)
    outs = llm.chat([msgs, [{"role": "user", "content": "Hi"}]], params, thinking_mode="thinking")
    assert [o.prompt for o in outs] == [
        encode_messages(msgs, thinking_mode="thinking"),
        encode_messages([{"role": "user", "content": "Hi"}], thinking_mode="thinking"),
    ]


# -- bad input ---------------------------------------------------------------------------------------

BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"so_args": {"schema_type": "yaml", "schema": "a: 1"}}, "so_args.schema_type"),
]


@pytest.mark.parametrize("kw, field", BAD_PARAMS)
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [5] * 64}, "prompt"),  # the limit (64) counts at least one generated token
        ({"prompt_token_ids": [5, VOCAB]}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1, 5]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, "7"]}, "prompt_token_ids"),
        (42, "prompt"),
    ],
)
def test_bad_prompts(short: LLM, prompt, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        short.generate(prompt, SamplingParams(max_tokens=2))
    assert not short.engine.has_unfinished_requests()


def test_stop_token_id_outside_vocab(short: LLM):
    with pytest.raises(ValueError, match="^stop_token_ids"):
        short.generate("Hi", SamplingParams(stop_token_ids=[VOCAB]))


def test_one_bad_prompt_queues_none(short: LLM):
    with pytest.raises(ValueError, match="^prompt_token_ids"):
        short.generate(["Hi", {"prompt_token_ids": [VOCAB]}], SamplingParams(max_tokens=2))
    assert not short.engine.has_unfinished_requests()
    assert short.engine.scheduler.pages.num_used == short.engine.scheduler.num_cached_pages
    with pytest.raises(ValueError, match="^sampling_params"):
        short.generate(["Hi", "Ho"], [SamplingParams(max_tokens=2)])
    assert not short.engine.has_unfinished_requests()


def test_longest_allowed_prompt_runs(short: LLM):
    (out,) = short.generate({"prompt_token_ids": [5] * 63}, SamplingParams(temperature=0, max_tokens=10))
    assert len(tokens(out)) == 1 and out.outputs[0].finish_reason == "length"


def test_engine_keeps_serving_after_refusals(short: LLM):
    good_ids = short.tokenizer.encode("Once upon a time", add_special_tokens=False).ids
    params = SamplingParams(temperature=0, max_tokens=12)
    (clean,) = short.generate({"prompt_token_ids": good_ids}, params)
    eng = short.engine
    eng.add_request("good", good_ids, params)
    outs = []
    for _ in range(3):
        outs += eng.step()
    bad_requests = [
        ([], params, "prompt"),
        ([5] * 64, params, "prompt"),
        ([5, VOCAB], params, "prompt_token_ids"),
        ([-1], params, "prompt_token_ids"),
        (good_ids, SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (good_ids, {"temperature": 0}, "sampling_params"),
    ]
    for k, (ids, p, field) in enumerate(bad_requests):
        with pytest.raises(ValueError, match=f"^{field}"):
            eng.add_request(f"bad-{k}", ids, p)
        assert f"bad-{k}" not in eng.scheduler.requests
        outs += eng.step()
    for kw, field in BAD_PARAMS:
        with pytest.raises(ValueError, match=f"^{field}"):
            eng.add_request("bad-params", good_ids, SamplingParams(**kw))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("good", good_ids, params)  # the id is taken while "good" runs
    while eng.has_unfinished_requests():
        outs += eng.step()
    (out,) = outs
    assert out.request_id == "good" and out.outputs[0].finish_reason == "length"
    assert tokens(out) == tokens(clean) and len(tokens(out)) == 12
    assert eng.scheduler.pages.num_used == eng.scheduler.num_cached_pages
