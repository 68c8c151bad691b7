"""Our DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (transformers 5.23), same weights, fp32."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.references import build_hf_model
from deepinfer.tokenizer import load_tokenizer
from models.tiny_configs import CONFIGS

TEXTS = [
    "DeepSeek-V4 compresses the KV cache: sliding window + CSA + HCA.",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up and barks.",
    "你好，世界！这是一个测试。",
    "def f(x):\n    return x * 2\n",
]


def prompts(vocab: int) -> list[list[int]]:
    tok = load_tokenizer()
    out = [[0] + tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    g = torch.Generator().manual_seed(7)
    for n in (1, 4, 37, 70):  # odd lengths that straddle windows and compression boundaries
        out.append(torch.randint(2, vocab, (n,), generator=g).tolist())
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tiny_dirs: dict) -> tuple[LLM, object]:
    llm = LLM(model=tiny_dirs[request.param], dtype="float32", page_size=16, num_pages=512)
    return llm, build_hf_model(llm.model)


def test_prompt_logprobs_match_transformers(pair: tuple) -> None:
    llm, hf = pair
    ps = prompts(llm.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=1, prompt_logprobs=5))
    worst = 0.0
    for p, out in zip(ps, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p]), use_cache=False).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            entry = out.prompt_logprobs[i]
            assert p[i] in entry
            for tok, lp in entry.items():
                worst = max(worst, abs(lp - float(ref[i - 1, tok])))
    assert worst <= 1e-4, f"max |Δ logprob| = {worst:.3g}"


def test_full_vocab_logprobs_match_transformers(pair: tuple) -> None:
    from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
    from deepinfer.models.deepseek_v4.state import SequenceState

    llm, hf = pair
    p = prompts(llm.config.vocab_size)[-1]
    cache = PagedKVCache(llm.config, 16, 16)
    batch = ForwardBatch.build([SeqChunk(SequenceState(), 0, len(p), torch.arange(16))], [p])
    ours = torch.log_softmax(llm.model.logits(llm.model(batch, cache)), -1)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p]), use_cache=False).logits[0].float(), -1)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_greedy_continuations_match_transformers(pair: tuple) -> None:
    llm, hf = pair
    ps = prompts(llm.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=32))
    for p, out in zip(ps, outs):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, use_cache=True)
        ref = gen[0, len(p) :].tolist()
        ours = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":  # EOS: transformers pads after it
            ref = ref[: len(ours)]
        assert ours == ref
