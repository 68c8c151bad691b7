"""Offline inference with deepinfer's LLM API on a tiny DeepSeek-V4.1 model (or the model in DEEPINFER_HF_MODEL_DIR).

python examples/offline_inference.py
"""

import os
import tempfile

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model


def main():
    model = os.environ.get("DEEPINFER_HF_MODEL_DIR") or make_tiny_model(
        tempfile.mkdtemp(prefix="deepinfer-tiny-"), arch="deepseek_v41"
    )
    llm = LLM(model=model)

    # plain prompts, greedy
    outputs = llm.generate(
        ["The capital of France is", "def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=16)
    )
    for out in outputs:
        print(repr(out.prompt), "->", repr(out.outputs[0].text), out.outputs[0].finish_reason, out.usage)

    # token ids in, seeded sampling with logprobs: the same seq_seed gives the same tokens
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seq_seed=1234, logprobs=2)
    a = llm.generate({"prompt_token_ids": [0, 1234, 5678]}, params)[0].outputs[0]
    b = llm.generate({"prompt_token_ids": [0, 1234, 5678]}, params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    print("seeded:", a.token_ids, "logprobs of the first token:", a.logprobs[0])

    # chat: DeepSeek-V4's chat encoding, thinking off
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8))
    print(repr(chat[0].prompt), "->", repr(chat[0].outputs[0].text))


if __name__ == "__main__":
    main()
