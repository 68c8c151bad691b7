"""Images through the mesh (DeepSeek-V4.1): worker, scheduler and balancer as real processes on the tiny V4.1
checkpoint with a vision tower; the ``openai`` client sends ``image_url`` parts, a gRPC client image bytes.

* a chat completion with an image gives ``LLM.chat``'s greedy tokens for the same conversation, and so does the
  gRPC Generation API (chat parts, and token ids + images);
* another image behind the same tokens gives other tokens; the same image in a follow-up resumes from the prefix
  cache past the image span (the scheduler's metrics count the hit), another image does not;
* resume hints survive the images: a thinking-mode conversation about an image resumes at its turn's point (right
  after ``<｜Assistant｜>``, moved past the span on the replica), the same text with another image does not, and the
  samples of an ``n`` > 1 image request resume one token short of the expanded prompt's end;
* bad input is refused with 400 naming the field (http(s) URLs, local files without the setting, bytes that are
  no image, a placeholder count that differs) and INVALID_ARGUMENT over gRPC; a V4 model refuses images.
"""

from __future__ import annotations

import asyncio
import base64
import io
import urllib.request

import grpc
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import LLM, SamplingParams
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 6


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


IMAGE_A, IMAGE_B = png(70, 50, 1), png(70, 50, 2)  # same size: the same span, the same tokens


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def user(image_url: str, text: str = "What is in it?") -> dict:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image_url}}]
    return {"role": "user", "content": parts}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(IMAGE_A)
    return root


@pytest.fixture(scope="module")
def mesh(tiny_v41_dir, media, tmp_path_factory: pytest.TempPathFactory):
    env = {"DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH": str(media)}
    m = Mesh(tiny_v41_dir, tmp_path_factory.mktemp("v41_images_logs"), extra_env=env).up(num_pages=64, http=True)
    yield m
    m.down()


@pytest.fixture(scope="module")
def llm(tiny_v41_dir) -> LLM:
    return LLM(model=tiny_v41_dir, page_size=16, num_pages=64)  # as the mesh's worker: the checkpoint's dtype


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)


def create(client: openai.OpenAI, messages: list[dict], **kw):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True}, **kw,
    )  # fmt: skip


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_chat_with_an_image_equals_llm_chat(client: openai.OpenAI, llm: LLM, media) -> None:
    (ref,) = llm.chat([user(data_url(IMAGE_A))], greedy())
    res = create(client, [user(data_url(IMAGE_A))])
    assert res.choices[0].message.content == ref.outputs[0].text
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)  # the image's span counted
    assert res.usage.completion_tokens == MAX_TOKENS
    # the same file under DEEPINFER_ALLOWED_LOCAL_MEDIA_PATH, by path and by file:// URL: the same reply
    for src in (str(media / "a.png"), f"file://{media}/a.png"):
        assert create(client, [user(src)]).choices[0].message.content == ref.outputs[0].text
    other = create(client, [user(data_url(IMAGE_B))])
    (ref_b,) = llm.chat([user(data_url(IMAGE_B))], greedy())
    assert other.choices[0].message.content == ref_b.outputs[0].text
    assert ref_b.outputs[0].token_ids != ref.outputs[0].token_ids  # the image changes the output


def test_grpc_generate_with_image_bytes(mesh: Mesh, llm: LLM) -> None:
    (ref,) = llm.chat([user(data_url(IMAGE_A))], greedy())
    text = "What is in it?"
    chat = generation_pb2.ChatInput(thinking_mode="chat")
    m = chat.messages.add(role="user")
    m.parts.add(text=text)
    m.parts.add(image=IMAGE_A)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    raw = [0, 17, 4242, llm.config.image_token_id, 99, 5]
    (ref_ids,) = llm.generate({"prompt_token_ids": raw, "multi_modal_data": {"image": IMAGE_B}}, greedy())

    async def run():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            outs = []
            for req in (
                generation_pb2.GenerateRequest(chat=chat, sampling=sampling),
                generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=raw), images=[IMAGE_B], sampling=sampling
                ),  # fmt: skip
            ):
                msgs = [x async for x in stub.Generate(req, timeout=120)]
                outs.append(([t for x in msgs for t in x.token_ids], msgs[-1].finished.usage.prompt_tokens))
            bad = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=raw), images=[b"no image"],
                                                 sampling=sampling)  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [x async for x in stub.Generate(bad, timeout=60)]
            two = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=raw),
                                                 images=[IMAGE_A, IMAGE_B], sampling=sampling)  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as e2:
                [x async for x in stub.Generate(two, timeout=60)]
            scored = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=raw), images=[IMAGE_A])
            scored.sampling.CopyFrom(sampling)
            scored.sampling.prompt_logprobs = 1
            with pytest.raises(grpc.aio.AioRpcError) as e3:
                [x async for x in stub.Generate(scored, timeout=60)]
            return outs, e.value, e2.value, e3.value

    (chat_out, ids_out), bad, two, scored = asyncio.run(run())
    assert scored.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in scored.details()
    assert chat_out == (ref.outputs[0].token_ids, len(ref.prompt_token_ids))
    assert ids_out == (ref_ids.outputs[0].token_ids, len(ref_ids.prompt_token_ids))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "not an image" in bad.details()
    assert two.code() == grpc.StatusCode.INVALID_ARGUMENT and "images: 2 image(s)" in two.details()


def hits(mesh: Mesh) -> float:
    text = urllib.request.urlopen(mesh.metrics_url("scheduler"), timeout=10).read().decode()
    return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == "vllm:prefix_cache_hits_total")  # fmt: skip


def test_the_same_image_resumes_past_its_span(client: openai.OpenAI, mesh: Mesh, llm: LLM) -> None:
    first = create(client, [user(data_url(IMAGE_A), "Describe it.")])
    (ref,) = llm.chat([user(data_url(IMAGE_A), "Describe it.")], greedy())
    span_end = len(ref.prompt_token_ids) - ref.prompt_token_ids[::-1].index(llm.config.image_token_id)
    follow = [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More?"}]
    before = hits(mesh)
    other = create(client, [user(data_url(IMAGE_B), "Describe it."), *follow])
    assert not other.usage.prompt_tokens_details or other.usage.prompt_tokens_details.cached_tokens < span_end
    same = create(client, [user(data_url(IMAGE_A), "Describe it."), *follow])
    cached = same.usage.prompt_tokens_details.cached_tokens
    assert cached >= span_end, (cached, span_end)
    assert hits(mesh) - before >= cached
    (cold,) = llm.chat([user(data_url(IMAGE_A), "Describe it."), *follow], greedy())
    assert same.choices[0].message.content == cold.outputs[0].text  # the resumed state is the image's


@pytest.mark.parametrize(
    ("content", "field", "says"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "messages[0].content[1].image_url",
         "not fetched from the network"),
        ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "messages[0].content[1].image_url",
         "outside allowed_local_media_path"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "messages[0].content[1].image_url",
         "does not decode"),
        ({"type": "image_url", "image_url": {"url": data_url(b"no image")}}, "images", "not an image"),
        ({"type": "image_url", "image_url": 3}, "messages[0].content[1].image_url", "expected {'url': str}"),
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content[1]", "only text and image_url parts"),
    ],
)  # fmt: skip
def test_bad_images_are_refused_naming_the_field(client: openai.OpenAI, content: dict, field: str, says: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, content]}]
    with pytest.raises(openai.BadRequestError) as e:
        create(client, messages)
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert field in message and says in message, message


def test_an_image_conversation_resumes_at_its_turn_and_not_with_another_image(
    client: openai.OpenAI, mesh: Mesh, llm: LLM
) -> None:
    """Thinking mode drops a reply's reasoning from the history, so the next turn shares the previous prompt only up
    to right after its ``<｜Assistant｜>``: the balancer's turn hint (a position of the prompt as sent, moved past the
    image's span on the replica) keeps a resume point there. The same text with another image never matches it."""
    model = client.models.list().data[0].id

    def ask(messages: list[dict]):
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": True}},
        )  # fmt: skip

    text = "Tell me about this picture, please."
    first = ask([user(data_url(IMAGE_A), text)])
    turn = first.usage.prompt_tokens - 1  # right after <｜Assistant｜> (the prompt ends <｜Assistant｜><think>)
    follow = [{"role": "assistant", "content": first.choices[0].message.content or ""},
              {"role": "user", "content": "And the colours?"}]  # fmt: skip
    (ref,) = llm.chat([user(data_url(IMAGE_A), text), *follow], greedy(), thinking_mode="thinking")
    span_start = ref.prompt_token_ids.index(llm.config.image_token_id)
    before = hits(mesh)
    same = ask([user(data_url(IMAGE_A), text), *follow])
    assert same.usage.prompt_tokens_details.cached_tokens == turn, (same.usage, turn)
    assert hits(mesh) - before >= turn
    assert same.choices[0].message.reasoning_content == ref.outputs[0].text.removesuffix("</think>")  # its state
    other = ask([user(data_url(IMAGE_B), text), *follow])
    cached = other.usage.prompt_tokens_details.cached_tokens if other.usage.prompt_tokens_details else 0
    assert cached <= span_start, (cached, span_start)


def test_image_samples_resume_from_the_first_ones_prompt(client: openai.OpenAI, mesh: Mesh) -> None:
    """``n`` > 1 with an image: the samples after the first resume one token short of the expanded prompt's end."""
    model = client.models.list().data[0].id
    before = hits(mesh)
    res = client.chat.completions.create(
        model=model, messages=[user(data_url(IMAGE_B), "Only the samples test asks this.")], max_tokens=2, n=3,
        temperature=1.0, seed=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert hits(mesh) - before >= 2 * (res.usage.prompt_tokens - 1)  # samples 1 and 2: only the last prompt token
