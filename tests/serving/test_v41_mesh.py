"""The mesh serves DeepSeek-V4.1: worker, scheduler and balancer as real processes on the tiny V4.1 checkpoint, the
``openai`` client against the balancer's HTTP API (a chat completion, then the same one streamed)."""

from __future__ import annotations

import openai
import pytest

from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def mesh(tiny_v41_dir, tmp_path_factory: pytest.TempPathFactory):
    m = Mesh(tiny_v41_dir, tmp_path_factory.mktemp("v41_mesh_logs")).up(num_pages=64, http=True)
    yield m
    m.down()


def test_v41_chat_completion_plain_and_streamed(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    kw = {"model": model, "messages": [{"role": "user", "content": "Hi there!"}], "max_tokens": 6, "temperature": 0}
    res = client.chat.completions.create(**kw)
    msg = res.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert res.usage.completion_tokens == 6 and res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens > 3  # BOS, <｜User｜>, the text, <｜Assistant｜></think>
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content  # greedy: the same
