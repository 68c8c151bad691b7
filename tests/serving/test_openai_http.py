"""The OpenAI-compatible HTTP API of the balancer: the real ``openai`` client against real processes, plus
unit tests of the reasoning splitter and of the error mapping (on a fake service, in process)."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import openai
import pytest

from deepinfer.chat.tokens import EOS, THINK_END, TOOL_CALLS_START
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.serving.metrics import Metrics
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.balancer.chat_output import ReasoningSplitter, parse_chat_output
from services.balancer.http import create_app
from services.balancer.openai_protocol import ChatCompletionRequest
from serving.mesh import Mesh

try:
    import httpx2 as httpx
except ImportError:  # older openai releases depend on httpx
    import httpx

pytestmark = pytest.mark.timeout(300)

CALL = (
    f'{TOOL_CALLS_START}>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


# -- the reasoning splitter on synthetic streams (no processes) -----------------------------------------
def split(text: str, reasoning: bool, seed: int) -> tuple[str, str, list[dict]]:
    """Feed ``text`` in random pieces; return the concatenated reasoning, content and the tool calls."""
    rng, s, pos, r, c = random.Random(seed), ReasoningSplitter(reasoning), 0, "", ""
    while pos < len(text):
        n = rng.randint(1, 6)
        dr, dc = s.feed(text[pos : pos + n])
        r, c, pos = r + dr, c + dc, pos + n
    dr, dc, calls = s.finish()
    return r + dr, c + dc, calls


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("text", "reasoning", "expected"),
    [
        ("Let me think.</think>The answer is 4.", True, ("Let me think.", "The answer is 4.", [])),
        ("no close <tag> </thin", True, ("no close <tag> </thin", "", [])),
        ("plain </think> text\n\n", False, ("", "plain </think> text\n\n", [])),
        (
            f"why</think>ok{CALL}{EOS}",
            True,
            ("why", "ok", [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}]),
        ),
        (
            f"a{TOOL_CALLS_START}>\n<｜DSML｜invoke name=",
            False,
            ("", f"a{TOOL_CALLS_START}>\n<｜DSML｜invoke name=", []),
        ),
    ],
)
def test_reasoning_splitter_on_streamed_deltas(text, reasoning, expected, seed) -> None:
    assert split(text, reasoning, seed) == expected


def test_parse_chat_output_is_strict_then_tolerant() -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    assert parse_chat_output(f"r{THINK_END}c{CALL}", True, "stop") == ("r", "c", [call])
    assert parse_chat_output(f"r{THINK_END}c</think>x", True, "stop") == ("r", "c</think>x", [])  # malformed
    assert parse_chat_output("never closed", True, "length") == ("never closed", "", [])
    assert parse_chat_output("never closed", True, "stop") == ("", "never closed", [])
    assert parse_chat_output(f"c{TOOL_CALLS_START}>\nbroken", False, "stop") == (
        "",
        f"c{TOOL_CALLS_START}>\nbroken",
        [],
    )


@pytest.mark.parametrize(
    ("extra", "thinking", "effort"),
    [
        ({}, False, ""),
        ({"reasoning_effort": "none"}, False, ""),
        ({"reasoning_effort": "high"}, True, "high"),
        ({"reasoning_effort": "max"}, True, "max"),
        ({"chat_template_kwargs": {"thinking": True}}, True, ""),
        ({"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "max"}, False, ""),
    ],
)
def test_thinking_mode_selection_sets_the_splitter_state(extra, thinking, effort) -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], **extra)
    wire, opens_reasoning = req.to_proto("r", 4096)
    assert (wire.chat.thinking_mode == "thinking", wire.chat.reasoning_effort) == (thinking, effort)
    assert opens_reasoning == thinking and len(wire.chat.tools) == 1
    assert not ChatCompletionRequest(messages=[], tools=[WEATHER], tool_choice="none").to_proto("r", 9)[0].chat.tools


# -- error mapping on a fake service (in process) ---------------------------------------------------------
class FakeTokenizer:
    def token_to_id(self, text: str) -> int:
        return 7

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return f"<{ids[0]}>"


class FakeService:
    info = generation_pb2.ModelInfo(model="fake", max_model_len=64, vocab_size=100)
    tokenizer = FakeTokenizer()

    def __init__(self, *script) -> None:
        self.script, self.closed = script, False

    async def generate(self, request, timeout=None):
        try:
            for item in self.script:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} details")


async def post(service, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_app(service, Metrics()))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


TOKEN = generation_pb2.GenerateResponse(token_ids=[5], text="hi", prompt_tokens=3)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED), 429),
        (rpc_error(grpc.StatusCode.UNAVAILABLE), 503),
        (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), 504),
        (rpc_error(grpc.StatusCode.INTERNAL), 500),
        (RuntimeError("secret stack detail"), 500),
    ],
)
def test_replica_errors_map_to_http_statuses(error, status) -> None:
    res = asyncio.run(post(FakeService(error), "/v1/completions", {"prompt": "x"}))
    err = res.json()["error"]
    assert res.status_code == status and set(err) == {"message", "type", "param", "code"}
    assert (res.headers.get("retry-after") == "1") == (status in (429, 503))  # worth a retry, later
    assert "secret" not in err["message"] and (status != 500 or err["message"] == "internal error")


def test_error_after_the_stream_started_is_an_sse_error_event() -> None:
    service = FakeService(TOKEN, rpc_error(grpc.StatusCode.UNAVAILABLE))
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    res = asyncio.run(post(service, "/v1/chat/completions", body))
    events = [line.removeprefix("data: ") for line in res.text.split("\n\n") if line]
    assert res.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "service_unavailable" and service.closed


def test_reasoning_is_split_in_messages_and_deltas() -> None:
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    last = generation_pb2.GenerateResponse(
        token_ids=[6],
        text="</think>ok",
        finished=generation_pb2.Finished(reason=common_pb2.FINISH_REASON_STOP, usage=usage),
    )
    body = {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"}
    msg = asyncio.run(post(FakeService(TOKEN, last), "/v1/chat/completions", body)).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("hi", "hi", "ok")
    res = asyncio.run(post(FakeService(TOKEN, last), "/v1/chat/completions", body | {"stream": True}))
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in res.text.split("\n\n")[:-2] if e]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "hi", "reasoning": "hi"},
        {"content": "ok"},
        {},
    ]


@pytest.mark.parametrize("cut", [CALL.index("Paris") + 2, CALL.index("invoke name") + 5, len(TOOL_CALLS_START) - 6])
def test_tool_call_cut_by_max_tokens_is_dropped_streamed_and_not(cut) -> None:
    """A tool call cut by max_tokens: finish_reason "length", no tool call, content only the text before the
    markup; the stream never carried any of the markup (nor the partial call)."""
    text = "Sure." + CALL[:cut]
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=9, total_tokens=12)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    outs = [generation_pb2.GenerateResponse(token_ids=[5], text=p) for p in pieces]
    outs[-1].finished.CopyFrom(generation_pb2.Finished(reason=common_pb2.FINISH_REASON_LENGTH, usage=usage))
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    choice = asyncio.run(post(FakeService(*outs), "/v1/chat/completions", body)).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "Sure."
    res = asyncio.run(post(FakeService(*outs), "/v1/chat/completions", body | {"stream": True}))
    chunks = [json.loads(e[6:])["choices"][0] for e in res.text.split("\n\n")[:-2] if e]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Sure."
    assert not any("tool_calls" in c["delta"] for c in chunks) and "｜" not in res.text
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]


def test_closed_tool_calls_before_the_cut_are_kept() -> None:
    second = CALL.replace(f"{TOOL_CALLS_START}>\n", "").replace("\n</｜DSML｜tool_calls>", "")
    text = "ok" + CALL.removesuffix("</｜DSML｜tool_calls>") + second[:40]
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=9, total_tokens=12)
    last = generation_pb2.GenerateResponse(token_ids=[5], text=text[10:])
    last.finished.CopyFrom(generation_pb2.Finished(reason=common_pb2.FINISH_REASON_LENGTH, usage=usage))
    outs = [generation_pb2.GenerateResponse(token_ids=[5], text=text[:10]), last]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    choice = asyncio.run(post(FakeService(*outs), "/v1/chat/completions", body)).json()["choices"][0]
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "ok"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}]
    res = asyncio.run(post(FakeService(*outs), "/v1/chat/completions", body | {"stream": True}))
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in res.text.split("\n\n")[:-2] if e]
    streamed = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [tc["function"] for tc in streamed] == calls and streamed[0]["index"] == 0 and streamed[0]["id"]


# -- the real mesh -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("http_model"), seed=5)
    m = Mesh(model, tmp_path_factory.mktemp("http_logs")).up(http=True)
    yield m
    m.down()


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def grpc_text(mesh: Mesh, prompt: str, max_tokens: int) -> str:
    async def run():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            sampling = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
            req = generation_pb2.GenerateRequest(text=prompt, sampling=sampling)
            return "".join([m.text async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req)])

    return asyncio.run(run())


def test_models_health_version(mesh: Mesh, model: str) -> None:
    assert model == mesh.model.name  # the directory's base name, never the server's filesystem path
    assert httpx.get(f"{mesh.http_url()}/health").status_code == 200
    assert httpx.get(f"{mesh.http_url()}/version").json()["version"]


def test_completions_match_grpc_streamed_and_not(mesh: Mesh, client: openai.OpenAI, model: str) -> None:
    res = client.completions.create(model=model, prompt="Hello there", max_tokens=8, temperature=0)
    assert res.choices[0].text == grpc_text(mesh, "Hello there", 8) and res.choices[0].finish_reason == "length"
    u = res.usage
    assert (u.completion_tokens, u.total_tokens) == (
        8,
        u.prompt_tokens + 8,
    ) and u.prompt_tokens_details.cached_tokens >= 0
    chunks = list(
        client.completions.create(
            model=model, prompt="Hello there", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == res.choices[0].text
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    ids = client.completions.create(model=model, prompt=[0, 11, 22], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_chat_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    res = client.chat.completions.create(**kw)
    msg = res.choices[0].message
    assert (
        msg.role == "assistant" and isinstance(msg.content, str) and "reasoning_content" not in (msg.model_extra or {})
    )
    assert (res.usage.completion_tokens, res.usage.total_tokens) == (6, res.usage.prompt_tokens + 6)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content


def test_logprobs_shapes(client: openai.OpenAI, model: str) -> None:
    res = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = res.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    lp = client.completions.create(model=model, prompt="Hello", max_tokens=4, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)


def test_stop_and_seed(client: openai.OpenAI, model: str) -> None:
    text = client.completions.create(model=model, prompt="Hello there", max_tokens=10, temperature=0).choices[0].text
    stop = text[3:6]
    cut = client.completions.create(model=model, prompt="Hello there", max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    seeded = [
        client.completions.create(model=model, prompt="Hi", max_tokens=8, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_thinking_mode_and_tool_choice_none(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    res = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    extra = res.choices[0].message.model_extra
    assert isinstance(extra["reasoning_content"], str) and extra["reasoning"] == extra["reasoning_content"]
    assert res.usage.completion_tokens_details.reasoning_tokens <= 4
    with_tools = client.chat.completions.create(model=model, messages=messages, max_tokens=1, tools=[WEATHER])
    none = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, tools=[WEATHER], tool_choice="none"
    )
    assert with_tools.usage.prompt_tokens > none.usage.prompt_tokens == res.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
        # a field neither endpoint takes, or this endpoint does not (OpenAI's unknown_parameter): never ignored
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1},
            400,
            "prompt_logprobs",
        ),  # fmt: skip
        (
            "/v1/completions",
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            400,
            "stream_options.x",
        ),  # fmt: skip
        # OpenAI options the engine cannot honour, and values of the wrong type
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": True}, 400, "store"),
        ("/v1/completions", {"prompt": "x", "service_tier": "flex"}, 400, "service_tier"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
            400,
            "functions",
        ),  # fmt: skip
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
            400,
            "modalities",
        ),  # fmt: skip
        ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "x", "response_format": {"a": 1}}, 400, "response_format"),
        ("/v1/completions", b'{"prompt": "x", ', 400, None),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ],
)
def test_bad_requests_are_openai_errors_and_the_server_stays_healthy(mesh: Mesh, path, body, status, param) -> None:
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    res = httpx.post(f"{mesh.http_url()}{path}", **kw)
    err = res.json()["error"]
    assert res.status_code == status and err["param"] == param and err["message"]
    assert httpx.get(f"{mesh.http_url()}/health").status_code == 200


def test_identifiers_and_default_options_are_taken(client: openai.OpenAI, model: str) -> None:
    """OpenAI's fields that change nothing generated are taken as they are: the output equals the bare request's."""
    messages = [{"role": "user", "content": "Say something"}]
    bare = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    tagged = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, user="u-1", metadata={"team": "a"}, store=False,
        service_tier="auto", modalities=["text"],
        extra_body={"safety_identifier": "s-1", "prompt_cache_key": "k-1"},
    )  # fmt: skip
    assert tagged.choices[0].message.content == bare.choices[0].message.content


def test_openai_client_sees_bad_request(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"


def test_a_model_without_image_input_refuses_images(mesh: Mesh, client: openai.OpenAI, model: str) -> None:
    """DeepSeek-V4 takes no images: an image_url part is 400 naming it, gRPC image bytes INVALID_ARGUMENT."""
    url = "data:image/png;base64,iVBORw0KGgo="
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert "messages[0].content[1].image_url: this model takes no image input" in e.value.body["message"]

    async def generate(req: generation_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30)]
            return err.value

    ids = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[0, 5]), images=[b"\x89PNG"])
    chat = generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(
        role="user", parts=[generation_pb2.ContentPart(image=b"\x89PNG")])]))  # fmt: skip
    for req, says in ((ids, "images: this model takes no image input"),
                      (chat, "chat.messages[0].parts[0].image: this model takes no image input")):  # fmt: skip
        err = asyncio.run(generate(req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details(), err.details()


def test_metrics_expose_the_counters(mesh: Mesh, client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt="Hi", max_tokens=2)
    text = httpx.get(f"{mesh.http_url()}/metrics").text
    for name in (
        f'deepinfer_balancer_requests_total{{model_name="{model}",route="/v1/completions",status="ok"}}',
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'vllm:request_success_total{finished_reason="length"',
    ):
        assert name in text


def test_client_disconnect_mid_stream_frees_the_pages(mesh: Mesh, model: str) -> None:
    body = {"model": model, "prompt": [0, 7, 8, 9], "max_tokens": 4000, "ignore_eos": True, "stream": True}

    async def loads():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            return (await stub.GetLoads(generation_pb2.GetLoadsRequest())).replicas[0]

    with httpx.stream("POST", f"{mesh.http_url()}/v1/completions", json=body, timeout=30) as res:
        lines = res.iter_lines()  # held: dropping the iterator would already close the connection
        first = next(line for line in lines if line.startswith("data: "))
        mid = asyncio.run(loads())
    assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
    assert mid.free_kv_pages < mid.total_kv_pages
    for _ in range(100):
        after = asyncio.run(loads())
        if after.free_kv_pages == after.total_kv_pages and after.running_requests == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert after.free_kv_pages == after.total_kv_pages and after.running_requests == 0
    assert 'route="/v1/completions",status="cancelled"' in httpx.get(f"{mesh.http_url()}/metrics").text
