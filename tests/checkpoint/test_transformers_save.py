"""DeepSeek-V4 checkpoints as transformers 5.23 saves them (``DeepseekV4ForCausalLM.save_pretrained``) load and serve
(docs/deepseek_v4.md, "Checkpoint layouts").

transformers' own model, random weights drawn here on its own parameters (no converter of ours involved), is
saved with its own ``save_pretrained``; our loader reads that directory (its config.json and its tensor names:
``model.`` prefix, ``attn.norm`` for the attention's ``kv_norm``, per-expert weights, no MTP block) and our model's
logits must match transformers' on the same prompts. Three tiny configs (``models.tiny_configs``), one saved in
shards. A checkpoint without MTP loads with a warning into a model without MTP; any other missing or unexpected
tensor, and an MTP block there in part, stays an error naming the tensor.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.loader import CheckpointError, load_checkpoint
from deepinfer.checkpoint.mtp import has_mtp
from deepinfer.checkpoint.references import hf_config
from deepinfer.checkpoint.tiny import TINY_V4
from deepinfer.checkpoint.tiny_files import tokenizer_dir
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from models.tiny_configs import CONFIGS

ATOL = 1e-4  # |Δ logprob| over the full vocabulary, fp32 on both sides
SHARDED = "odd"  # saved with a small max_shard_size: index + several files


def randomize(hf: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for every parameter of transformers' model (its init leaves sinks, biases and mHC bases at
    zero and norms at one), and a random hash routing table."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(("base", "sinks", "position_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("fn"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # projections and stacked experts: ~unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):  # distinct experts per token
                b.copy_(torch.rand(b.shape[0], hf.config.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object, Path]:
    """(config name, transformers' model, the directory its save_pretrained wrote)."""
    from transformers import DeepseekV4ForCausalLM

    name = request.param
    config = DeepseekV4Config.from_dict({**TINY_V4, **CONFIGS[name]})
    torch.manual_seed(list(CONFIGS).index(name))
    hf = DeepseekV4ForCausalLM(hf_config(config)).float()
    randomize(hf, seed=list(CONFIGS).index(name))
    hf.eval()
    path = tmp_path_factory.mktemp("hf_saved") / name
    hf.save_pretrained(path, max_shard_size="500KB" if name == SHARDED else "2GB")
    return name, hf, path


def load(path: Path) -> DeepseekV4Model:
    model = DeepseekV4Model(DeepseekV4Config.from_file(path / "config.json"))
    load_checkpoint(model, path, torch.float32, progress=False)
    model.set_quant_sim(False)
    return model


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (1, 9, 37, 70)]


def our_logprobs(model: DeepseekV4Model, p: list[int]) -> torch.Tensor:
    cache = PagedKVCache(model.config, 16, 16)
    batch = ForwardBatch.build([SeqChunk(SequenceState(), 0, len(p), torch.arange(16))], [p])
    return torch.log_softmax(model.logits(model(batch, cache)), -1)


def hf_logprobs(hf, p: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([p]), use_cache=False).logits[0].float(), -1)


def test_save_pretrained_writes_its_own_names(saved: tuple) -> None:
    """The layout this loader must take (if transformers changes it, this says so first)."""
    name, _, path = saved
    keys = set()
    for f in path.glob("*.safetensors"):
        keys |= set(load_file(f))
    assert "model.layers.0.attn.norm.weight" in keys and "head.weight" in keys
    assert not any(k.startswith("mtp.") for k in keys)
    assert (path / "model.safetensors.index.json").exists() == (name == SHARDED)


def test_logits_match_transformers(saved: tuple) -> None:
    _, hf, path = saved
    with capture_logs() as logs:
        model = load(path)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "checkpoint has no MTP block: speculative decoding is off for this model"
    ]
    assert model.config.num_nextn_predict_layers == 1 and not has_mtp(model) and len(model.mtp) == 0
    worst = max((our_logprobs(model, p) - hf_logprobs(hf, p)).abs().max().item() for p in prompts(hf.config.vocab_size))
    assert worst <= ATOL, f"max |Δ logprob| = {worst:.3g}"


@pytest.mark.parametrize("saved", ["base"], indirect=True)
def test_engine_serves_a_transformers_save(saved: tuple, tmp_path: Path) -> None:
    """Through the engine: ``LLM`` on the saved directory (with the tokenizer saved beside it)."""
    from transformers import AutoTokenizer

    _, hf, path = saved
    served = tmp_path / "served"
    shutil.copytree(path, served)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(served)
    llm = LLM(model=served, dtype="float32", page_size=16, num_pages=128)
    assert not has_mtp(llm.model)
    ps = prompts(hf.config.vocab_size)[1:]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=1, prompt_logprobs=3))
    worst = 0.0
    for p, out in zip(ps, outs):
        ref = hf_logprobs(hf, p)
        for i in range(1, len(p)):
            worst = max(worst, *(abs(lp - float(ref[i - 1, t])) for t, lp in out.prompt_logprobs[i].items()))
    assert worst <= ATOL, f"max |Δ logprob| = {worst:.3g}"


def edited(path: Path, dest: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of a single-file save with tensor ``drop`` removed and ``add`` added."""
    shutil.copytree(path, dest)
    tensors = load_file(dest / "model.safetensors")
    if drop is not None:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("saved", ["base", "wide"], indirect=True)
def test_other_missing_tensor_is_named(saved: tuple, tmp_path: Path) -> None:
    _, _, path = saved
    bad = edited(path, tmp_path / "bad", drop="model.layers.1.attn.norm.weight")
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensors, e\.g\. layers\.1\.attn\.kv_norm\.weight"):
        load(bad)


@pytest.mark.parametrize("saved", ["base", "wide"], indirect=True)
def test_unexpected_tensor_is_named(saved: tuple, tmp_path: Path) -> None:
    _, _, path = saved
    bad = edited(path, tmp_path / "bad", add={"model.layers.0.attn.extra.weight": torch.zeros(4)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.0\.attn\.extra\.weight'"):
        load(bad)


@pytest.mark.parametrize("saved", ["base", "wide"], indirect=True)
def test_partial_mtp_block_is_an_error(saved: tuple, tmp_path: Path) -> None:
    """Only a checkpoint with no MTP tensor at all loads without MTP; one stray MTP tensor means a broken block."""
    _, _, path = saved
    c = DeepseekV4Config.from_file(path / "config.json")
    mix = (2 + c.hc_mult) * c.hc_mult
    bad = edited(path, tmp_path / "bad", add={"mtp.0.hc_attn_fn": torch.zeros(mix, c.hc_mult * c.hidden_size)})
    with pytest.raises(CheckpointError, match=r"e\.g\. mtp\.0\."):
        load(bad)
