"""Image prompts served by the engine (DeepSeek-V4.1, ``LLM`` on the tiny random V4.1 checkpoint, fp32, CPU).

* the engine's image prompt gives what the model gives the whole prompt spliced in one forward
  (``DeepseekV41Model.input_embeddings``); the image changes the output;
* chunked prefill cutting the image span, and batching with other requests, change nothing;
* prefix caching: a different image behind the same placeholder tokens never resumes from the other's state, the
  same image does, and both equal a cold prefill;
* ``LLM.chat``'s ``image_url`` parts and ``generate``'s ``multi_modal_data`` give the same request;
* sources: data: URLs, bytes, PIL images; local files only under ``allowed_local_media_path``; no http(s);
* bad input raises ValueError naming the field; DeepSeek-V4 refuses images.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.chat import encode_messages
from deepinfer.checkpoint.tiny_v41 import IMAGE_PLACEHOLDER
from deepinfer.models.deepseek_v4.family import DeepseekV4Family
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41.image import expand_image_placeholders, preprocess_image

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]  # one_thread: tests/engine/conftest.py

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
TEXT_BEFORE, TEXT_AFTER = [0, 17, 4242], [99, 5, 6, 7]


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


IMAGE_A, IMAGE_B = png(70, 50, 1), png(70, 50, 2)  # same size: the same span, the same placeholder tokens


def engine(path, **kw) -> LLM:
    return LLM(model=path, dtype="float32", **{"num_pages": 128, "page_size": 16, "quant_sim": False, **kw})


@pytest.fixture(scope="module")
def llm(tiny_v41_dir) -> LLM:
    return engine(tiny_v41_dir)


def raw_ids(llm: LLM, tail: list[int] = TEXT_AFTER) -> list[int]:
    return [*TEXT_BEFORE, llm.config.image_token_id, *tail]


def image_prompt(llm: LLM, image, tail: list[int] = TEXT_AFTER) -> dict:
    return {"prompt_token_ids": raw_ids(llm, tail), "multi_modal_data": {"image": image}}


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def assert_same(out, ref) -> None:
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert tokens(out) == tokens(ref), (tokens(out), tokens(ref))
    for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 * max(1.0, abs(a[t])) for t in a), (a, b)


@torch.no_grad()
def whole_prompt_logprobs(llm: LLM, image: bytes) -> tuple[list[int], torch.Tensor]:
    """The expanded ids and the last position's logprobs of the model on the whole prompt in one forward, the
    image spliced by ``input_embeddings`` (no engine)."""
    model = llm.model
    pre = preprocess_image(image, model.config.vision_config)
    ids, types = expand_image_placeholders(raw_ids(llm), [pre], model.config.image_token_id)
    embeds, mask = model.input_embeddings(torch.tensor(ids), torch.tensor(types), [model.encode_image(pre)])
    chunk = SeqChunk(SequenceState(), 0, len(ids), torch.arange(4))
    batch = ForwardBatch.build([chunk], [ids])
    batch.input_embeds, batch.image_mask = embeds, mask
    return ids, model.logits(model(batch, PagedKVCache(model.config, 4, 16)))[-1].log_softmax(-1)


def test_an_image_prompt_equals_the_model_on_the_whole_prompt(llm: LLM) -> None:
    (out,) = llm.generate(image_prompt(llm, IMAGE_A), GREEDY)
    ids, ref = whole_prompt_logprobs(llm, IMAGE_A)
    assert out.prompt_token_ids == ids and len(ids) == len(raw_ids(llm)) - 1 + 8  # a 2x2 grid: an 8-position span
    first, lp = tokens(out)[0], out.outputs[0].logprobs[0]
    assert first == int(ref.argmax()) and abs(lp[first] - float(ref[first])) <= 1e-5
    _, other = whole_prompt_logprobs(llm, IMAGE_B)
    assert float((other - ref).abs().max()) > 1e-2  # the image matters: the test would see a wrong one
    (out_b,) = llm.generate(image_prompt(llm, IMAGE_B), GREEDY)
    assert abs(out_b.outputs[0].logprobs[0][tokens(out_b)[0]] - float(other[tokens(out_b)[0]])) <= 1e-5


def test_chunked_prefill_cutting_the_span_and_batching_change_nothing(tiny_v41_dir, llm: LLM) -> None:
    prompts = [image_prompt(llm, IMAGE_A), "Once upon a time", image_prompt(llm, [IMAGE_B], tail=[8, 9])]
    alone = [llm.generate(p, GREEDY)[0] for p in prompts]
    # chunks of 5 (then 3, 2 ...): the span [3, 11) is cut at 5 and 10; two image requests share steps
    chunked = engine(tiny_v41_dir, max_num_batched_tokens=5, enable_prefix_caching=False)
    for out, ref in zip(chunked.generate(prompts, GREEDY), alone):
        assert_same(out, ref)
    assert tokens(alone[0]) != tokens(alone[2])


def test_prefix_cache_keys_cover_the_image(llm: LLM) -> None:
    """A follow-up of a finished image request: with another image of the same size (same tokens) it must not
    resume past the span's start; with the same image it resumes past the span; both equal a cold prefill."""
    llm.reset_prefix_cache()
    (first,) = llm.generate(image_prompt(llm, IMAGE_A), GREEDY)
    tail = [*TEXT_AFTER, *tokens(first), 301, 302, 303]
    (other,) = llm.generate(image_prompt(llm, IMAGE_B, tail), GREEDY)
    (same,) = llm.generate(image_prompt(llm, IMAGE_A, tail), GREEDY)
    assert other.prompt_token_ids == same.prompt_token_ids  # only the image differs
    assert other.num_cached_tokens <= len(TEXT_BEFORE)  # nothing of A's image state reused
    assert same.num_cached_tokens >= len(first.prompt_token_ids) and same.cache_tier == "device"
    llm.reset_prefix_cache()
    cold_other, cold_same = (llm.generate(image_prompt(llm, img, tail), GREEDY)[0] for img in (IMAGE_B, IMAGE_A))
    assert cold_other.num_cached_tokens == 0
    assert_same(other, cold_other)
    assert_same(same, cold_same)
    assert tokens(cold_other) != tokens(cold_same)


def test_chat_image_parts_and_sources(tmp_path, tiny_v41_dir, llm: LLM) -> None:
    url = "data:image/png;base64," + base64.b64encode(IMAGE_A).decode()
    content = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": url}}]
    (chat,) = llm.chat([{"role": "user", "content": content}], GREEDY)
    text = encode_messages([{"role": "user", "content": f"What is in it?\n\n{IMAGE_PLACEHOLDER}"}])
    (ref,) = llm.generate({"prompt": text, "multi_modal_data": {"image": [IMAGE_A]}}, GREEDY)
    assert_same(chat, ref)
    assert chat.prompt_token_ids.count(llm.config.image_token_id) == 8
    from PIL import Image

    (from_pil,) = llm.generate(image_prompt(llm, Image.open(io.BytesIO(IMAGE_A))), GREEDY)
    (from_url,) = llm.generate(image_prompt(llm, url), GREEDY)
    (path_out,) = llm.generate(image_prompt(llm, IMAGE_A), GREEDY)
    assert_same(from_pil, path_out)
    assert_same(from_url, path_out)
    (tmp_path / "a.png").write_bytes(IMAGE_A)
    with pytest.raises(ValueError, match=r"prompts\[0\]\.multi_modal_data\.image\[0\]: local image files are not"):
        llm.generate(image_prompt(llm, str(tmp_path / "a.png")), GREEDY)
    local = engine(tiny_v41_dir, allowed_local_media_path=tmp_path / "media")
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(IMAGE_A)
    for src in (str(tmp_path / "media" / "a.png"), f"file://{tmp_path}/media/a.png"):
        assert_same(local.generate(image_prompt(local, src), GREEDY)[0], path_out)
    with pytest.raises(ValueError, match="outside allowed_local_media_path"):
        local.generate(image_prompt(local, str(tmp_path / "a.png")), GREEDY)


def test_bad_image_input_is_refused(llm: LLM) -> None:
    def refused(prompt, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY)

    ok = image_prompt(llm, IMAGE_A)
    refused(image_prompt(llm, "https://example.com/cat.png"), r"image\[0\]: images are not fetched from the network")
    refused(image_prompt(llm, [IMAGE_A, IMAGE_B]), r"prompt: 1 image placeholder token\(s\) .* but 2 image\(s\)")
    refused(image_prompt(llm, b"not an image"), "images: the bytes are not an image")
    refused(image_prompt(llm, "data:image/png,abc"), "a data: URL must be base64")
    refused(image_prompt(llm, 3), r"image\[0\]: an image must be bytes")
    refused({**ok, "multi_modal_data": {"video": IMAGE_A}}, r"multi_modal_data: only \{'image': \.\.\.\}")
    refused({**ok, "multi_modal_data": {"image": []}}, "at least one image is required")
    bad_chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url: images are not fetched"):
        llm.chat(bad_chat, GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\]\.multi_modal_data\.image\[0\]: images are not"):
        llm.generate([image_prompt(llm, IMAGE_A), image_prompt(llm, "http://x")], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_deepseek_v4_refuses_images() -> None:
    v4 = DeepseekV4Family()
    with pytest.raises(ValueError, match="images: deepseek_v4 takes no image input"):
        v4.prepare_images(None, None, [1, 2], [IMAGE_A])
    with pytest.raises(ValueError, match="images: deepseek_v4 takes no image input"):
        v4.image_encoder(None)
    with pytest.raises(ValueError, match="images: deepseek_v4 takes no image input"):
        v4.batch([(SequenceState(), 0, 1, torch.arange(1), None)], [[5]], "cpu", [object()])
