"""An image prompt served by the engine (``LLM.generate`` with ``multi_modal_data``) against NeMo AutoModel 0.7.0's
DeepseekV41ForCausalLM given the same image through its own processor and vision path (fp32, CPU).

The tiny ``mixed`` configuration with a vision tower (``models.nemo_v41``: random weights), saved by NeMo's own
``save_pretrained`` and loaded by the engine from that folder; NeMo runs under ``reference_rules`` (the documented
top-k tie rule, no cache rounding; the engine with ``quant_sim=False``). Greedy decoding, NeMo re-running its full
forward (pixels and ``vision_token_types`` included) for every token: the same expanded prompt, the same greedy
tokens, and the logprobs of each step's top tokens within 1e-4 — with the prompt prefilled whole and in chunks that
cut the image span.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from models.tiny_v41 import IMAGE_PLACEHOLDER, build_tokenizer

ATOL = 1e-4
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def saved(nemo, tokenizer, tmp_path_factory):
    """(NeMo's model, the folder its save_pretrained wrote)."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    import models.nemo_v41 as helper

    backend = dataclasses.replace(helper.nemo_backend(), enable_hf_state_dict_adapter=True)
    with pytest.MonkeyPatch.context() as mp:  # NeMo then saves under the released names
        mp.setattr(helper, "nemo_backend", lambda: backend)
        theirs, _ = helper.build_pair("mixed", tokenizer, seed=4, vision=True)
    root = tmp_path_factory.mktemp("nemo_v41_vision")
    checkpointer = Checkpointer(CheckpointingConfig(checkpoint_dir=str(root), save_consolidated="final"), 0, 0, 0)
    theirs.save_pretrained(str(root), checkpointer=checkpointer, tokenizer=tokenizer, is_final_checkpoint=True)
    return theirs, root


def _image(width: int, height: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@torch.no_grad()
def nemo_greedy(theirs, batch: dict, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """NeMo's greedy tokens and each step's logprobs [V], its full forward re-run with the image every step."""
    from models.nemo_v41 import reference_rules

    ids, types = batch["input_ids"], batch["vision_token_types"]
    out, lps = [], []
    with reference_rules(), torch.compiler.set_stance("force_eager"):
        for _ in range(steps):
            logits = theirs(
                ids,
                pixel_values=batch["pixel_values"],
                image_grid_hws=batch["image_grid_hws"],
                vision_token_types=types,
            ).logits[0, -1]
            lp = logits.float().log_softmax(-1)
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(lp)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            types = torch.cat([types, torch.full((1, 1), -1, dtype=types.dtype)], dim=1)
    return out, lps


def test_engine_image_prompt_matches_nemo(saved, tokenizer) -> None:
    from nemo_automodel.components.models.deepseek_v41.processing import DeepseekV41Processor

    theirs, root = saved
    image = _image(70, 50, seed=6)
    text = f"w1 w2 {IMAGE_PLACEHOLDER} w3 w4 w5"
    batch = DeepseekV41Processor(tokenizer=tokenizer, config=theirs.config)(
        text=text, images=[image], return_tensors="pt"
    )
    want, ref = nemo_greedy(theirs, batch, MAX_TOKENS)
    other = DeepseekV41Processor(tokenizer=tokenizer, config=theirs.config)(
        text=text, images=[_image(70, 50, seed=7)], return_tensors="pt"
    )
    assert float((nemo_greedy(theirs, other, 1)[1][0] - ref[0]).abs().max()) > 1e-2  # the image matters here
    png = io.BytesIO()
    image.save(png, format="PNG")  # lossless: the engine decodes the pixels NeMo got
    prompt = {
        "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
        "multi_modal_data": {"image": png.getvalue()},
    }
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    span = [i for i, t in enumerate(batch["vision_token_types"][0].tolist()) if t >= 0]
    worst = 0.0
    for chunk in (None, 5):  # whole; chunks of 5 cut the span (positions 2..9) at 5
        llm = LLM(model=root, dtype="float32", num_pages=64, page_size=8, quant_sim=False, max_num_batched_tokens=chunk)
        (out,) = llm.generate(prompt, params)
        assert out.prompt_token_ids == batch["input_ids"][0].tolist() and span[0] < 5 < span[-1]
        assert out.outputs[0].token_ids == want
        for got, lp in zip(out.outputs[0].logprobs, ref):
            worst = max(worst, *(abs(v - float(lp[t])) for t, v in got.items()))
    print(f"image prompt ({len(span)}-position span): max |Δ logprob| over {MAX_TOKENS} greedy steps = {worst:.2e}")
    assert worst <= ATOL
