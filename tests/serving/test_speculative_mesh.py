"""Speculative decoding through the mesh: a worker with DEEPINFER_USE_NEXTN_DECODE=3 (its MTP drafts verified in one
step) serves greedy completions token for token like the engine without speculation, and the usage reports the drafts
(OpenAI's accepted / rejected prediction tokens); a DeepSeek-V4.1 worker drafting with DSpark at confidence-scheduled
lengths serves greedy and seeded requests bit for bit like the engine (batch-invariant ops). Plus, in process: the
scheduler service delivers only the tokens the scheduler kept of a multi-token result, and the balancer cuts an event
of several tokens at a stop string.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import openai
import pytest

try:
    import httpx2 as httpx  # what openai depends on
except ImportError:  # older openai releases depend on httpx
    import httpx

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine.interfaces import SeqResult, StepResult
from deepinfer.engine.pages import PagePool
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.scheduler_config import SchedulerConfig
from deepinfer.tokenizer import encode_ids, load_tokenizer
from deepinfer.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2
from services.balancer.http_choices import summed_usage, usage
from services.balancer.relay import Relay
from services.scheduler.delivery import output_lengths, token_events
from serving.mesh import Mesh

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[0, 11, 22, 33], [0, 5, 6, 7, 8, 9, 10, 11, 12], [0, 42]]


# -- in process ----------------------------------------------------------------------------------------
def test_delivery_keeps_only_the_tokens_the_scheduler_kept() -> None:
    eos = 1
    s = Scheduler(SchedulerConfig(page_size=16, max_model_len=128, eos_token_id=eos, num_speculative_tokens=3),
                  PagePool(16))  # fmt: skip
    s.add("a", [0, 5, 6], SamplingParams(temperature=0, max_tokens=10, logprobs=1))
    s.add("b", [0, 7], SamplingParams(temperature=0, max_tokens=10))
    s.schedule()
    result = StepResult(
        1,
        [  # "a" keeps 3 of its 4 tokens (EOS ends it), "b" all 3
            SeqResult("a", 40, -0.5, [(40, -0.5)], extra_token_ids=[41, eos, 43], extra_logprobs=[-1.0, -1.5, -2.0],
                      extra_top_logprobs=[[(41, -1.0)], [(eos, -1.5)], [(43, -2.0)]], num_drafts=3),
            SeqResult("b", 50, -0.1, extra_token_ids=[51, 52], extra_logprobs=[-0.2, -0.3], num_drafts=3),
        ],
    )  # fmt: skip
    before = output_lengths(s, result)
    events, done = token_events(s, result, before, s.update(result), {})
    a, b = events["a"], events["b"]
    assert list(a.token_ids) == [40, 41, eos] and [lp.logprob for lp in a.logprobs] == [-0.5, -1.0, -1.5]
    assert [[(t.token_id, t.logprob) for t in lp.top] for lp in a.logprobs] == [
        [(40, -0.5)],
        [(41, -1.0)],
        [(eos, -1.5)],
    ]
    assert a.finish_reason == common_pb2.FINISH_REASON_STOP and (a.draft_tokens, a.accepted_draft_tokens) == (3, 3)
    assert list(done) == ["a"]
    assert list(b.token_ids) == [50, 51, 52] and b.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert (b.draft_tokens, b.accepted_draft_tokens) == (3, 2)  # the counts so far, on each event with tokens


def test_relay_cuts_a_multi_token_event_at_a_stop_string() -> None:
    tok = load_tokenizer()
    ids = encode_ids(tok, "one two three four five")
    params = SamplingParams(temperature=0, stop=["three"])
    relay = Relay("r", [0, 1, 2], params, tok)
    ev = scheduler_pb2.TokenEvent(request_id="r", token_ids=ids, draft_tokens=8, accepted_draft_tokens=5)
    ev.logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in ids)
    out = relay.response(ev)
    cut = next(k for k in range(1, len(ids) + 1) if "three" in tok.decode(ids[:k]))
    assert cut < len(ids) and list(out.token_ids) == ids[:cut] and len(out.logprobs) == cut
    assert relay.generated == ids[:cut] and out.text == "one two "
    f = out.finished
    assert f.stop_string == "three" and f.usage.completion_tokens == cut
    assert (f.usage.draft_tokens, f.usage.accepted_draft_tokens) == (8, 5)


def test_usage_reports_prediction_tokens() -> None:
    u = common_pb2.Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8, draft_tokens=6, accepted_draft_tokens=2)
    assert usage(u)["completion_tokens_details"] == {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 4}
    assert "completion_tokens_details" not in usage(common_pb2.Usage(prompt_tokens=3))
    both = summed_usage([u, u], [1, 2])
    assert both["completion_tokens_details"] == {
        "reasoning_tokens": 3, "accepted_prediction_tokens": 4, "rejected_prediction_tokens": 8}  # fmt: skip
    assert both["completion_tokens"] == 10 and u.draft_tokens == 6  # the first sample's usage is left as it was


# -- the real mesh -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec_model"), seed=5)


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # the scheduler drafts at every step (its cost policy would turn drafting off once plain steps measure cheaper,
    # and these tests count drafts)
    spec = {"worker": {"DEEPINFER_USE_NEXTN_DECODE": "3"}, "scheduler": {"DEEPINFER_SPEC_DECODE_EXPLORE_STEPS": "0"}}
    m = Mesh(model_dir, tmp_path_factory.mktemp("spec_logs"), service_env=spec).up(http=True)
    yield m
    m.down()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[tuple[list[int], str]]:
    """Greedy tokens and text of the engine without speculation."""
    llm = LLM(model=model_dir, dtype="float32", page_size=16, num_pages=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12))
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def test_greedy_tokens_equal_and_usage_reports_drafts(mesh: Mesh, reference: list[tuple[list[int], str]]) -> None:
    async def run():
        async with grpc.aio.insecure_channel(mesh.address("balancer")) as ch:
            s = generation_pb2_grpc.GenerationStub(ch)
            sampling = common_pb2.SamplingParams(temperature=0, max_tokens=12, logprobs=0)
            ids = [generation_pb2.TokenIds(ids=p) for p in PROMPTS]
            reqs = [generation_pb2.GenerateRequest(token_ids=x, sampling=sampling) for x in ids]
            return await asyncio.gather(*[_collect(s, r) for r in reqs])

    drafts = 0
    for msgs, (ref, text) in zip(asyncio.run(run()), reference):
        assert "".join(m.text for m in msgs) == text
        tokens = [t for m in msgs for t in m.token_ids]
        assert tokens == ref and [lp.token_id for m in msgs for lp in m.logprobs] == ref
        u = msgs[-1].finished.usage
        assert u.completion_tokens == len(ref) and 0 <= u.accepted_draft_tokens <= u.draft_tokens
        drafts += u.draft_tokens
    assert drafts > 0  # the worker drafted (with random weights few drafts, if any, are accepted)


def test_openai_usage_reports_prediction_tokens(mesh: Mesh, reference: list[tuple[list[int], str]]) -> None:
    client = openai.OpenAI(base_url=f"{mesh.http_url()}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    (ref, text) = reference[0]
    res = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert res.choices[0].text == text and res.usage.completion_tokens == len(ref)
    d = res.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= 0 and d.rejected_prediction_tokens >= 0
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == res.choices[0].text
    sd = chunks[-1].usage.completion_tokens_details
    assert sd.accepted_prediction_tokens + sd.rejected_prediction_tokens > 0
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    cd = chat.usage.completion_tokens_details
    assert cd.accepted_prediction_tokens + cd.rejected_prediction_tokens > 0


def test_scheduler_exports_vllm_speculation_metrics(mesh: Mesh, reference: list[tuple[list[int], str]]) -> None:
    """After the tests above ran: the scheduler's Prometheus text has vLLM's spec-decode counters, consistent with
    each other, and the acceptance-length histogram counts one observation per verified sequence."""
    text = httpx.get(mesh.metrics_url("scheduler")).text
    value = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("vllm:spec_decode_", "deepinfer_spec_decode_")) and "_per_pos" not in line
    }
    drafts, tokens = value["vllm:spec_decode_num_drafts_total"], value["vllm:spec_decode_num_draft_tokens_total"]
    assert drafts > 0 and drafts <= tokens <= 3 * drafts
    assert 0 <= value["vllm:spec_decode_num_accepted_tokens_total"] <= tokens
    assert value["deepinfer_spec_decode_acceptance_length_count"] == drafts
    assert value["deepinfer_spec_decode_acceptance_length_sum"] == drafts + value[
        "vllm:spec_decode_num_accepted_tokens_total"]  # fmt: skip
    assert 'deepinfer_spec_decode_acceptance_length_bucket{le="4.0"' in text  # 1 .. drafts + 1, whatever was seen
    assert "deepinfer_spec_decode_steps_off_total" in value
    assert 'reason="batch"' in text and 'reason="cost"' in text


@pytest.fixture(scope="module")
def mesh_v41(tiny_v41_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """DeepSeek-V4.1: DSpark drafts up to 4 with confidence-scheduled lengths; batch-invariant ops on the worker and
    in the reference, so that verify rows compute what decode rows do, bit for bit (the checkpoint is bf16)."""
    worker = {"DEEPINFER_USE_NEXTN_DECODE": "4", "DEEPINFER_ENABLE_MTP_VARLEN": "1",
              "DEEPINFER_SPEC_DECODE_MIN_SURVIVAL": "0.2", "DEEPINFER_BATCH_INVARIANT": "1"}  # fmt: skip
    spec = {"worker": worker, "scheduler": {"DEEPINFER_SPEC_DECODE_EXPLORE_STEPS": "0"}}
    m = Mesh(tiny_v41_dir, tmp_path_factory.mktemp("spec_v41_logs"), service_env=spec).up(num_pages=64, http=False)
    yield m
    m.down()


def test_dspark_through_the_mesh(mesh_v41: Mesh, tiny_v41_dir: Path) -> None:
    """Greedy and seeded requests through the balancer give the engine's tokens without speculation (and their
    logprobs, bit for bit), with drafts verified and reported."""
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=0),
              SamplingParams(temperature=1.0, seed=7, max_tokens=12, logprobs=0)]  # fmt: skip
    llm = LLM(model=tiny_v41_dir, page_size=16, num_pages=64, batch_invariant=True)
    want = [llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp) for sp in params]

    async def run():
        async with grpc.aio.insecure_channel(mesh_v41.address("balancer")) as ch:
            s = generation_pb2_grpc.GenerationStub(ch)
            reqs = [
                generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=p),
                    sampling=common_pb2.SamplingParams(
                        temperature=sp.temperature,
                        max_tokens=12,
                        logprobs=0,
                        **({"seed": sp.seed} if sp.seed is not None else {}),
                    ),
                )  # fmt: skip
                for sp in params
                for p in PROMPTS
            ]
            return await asyncio.gather(*[_collect(s, r) for r in reqs])

    got, drafts = asyncio.run(run()), 0
    for msgs, ref in zip(got, [o for outs in want for o in outs]):
        assert [t for m in msgs for t in m.token_ids] == ref.outputs[0].token_ids
        lps = [lp.logprob for m in msgs for lp in m.logprobs]
        assert lps == [d[t] for d, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
        drafts += msgs[-1].finished.usage.draft_tokens
    assert drafts > 0


async def _collect(s: generation_pb2_grpc.GenerationStub, req: generation_pb2.GenerateRequest) -> list:
    return [m async for m in s.Generate(req, timeout=120)]
