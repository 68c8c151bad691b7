"""DeepSeek-V4.1 checkpoints as NeMo AutoModel 0.7.0 saves them load and serve (docs/deepseek_v41.md, "Checkpoint
layouts").

NeMo's own ``DeepseekV41ForCausalLM`` (tiny configs of ``models.tiny_v41``, random weights: ``models.nemo_v41``), built
with its state-dict adapter on, is saved by its own ``save_pretrained`` through its ``Checkpointer`` (the adapter's
``to_hf`` gives the released names; the consolidated export writes config.json, tokenizer and safetensors under
``model/consolidated``). Our loader reads that folder; the result must hold NeMo's weights bit for bit and give
NeMo's logits. NeMo builds the DSpark stages apart, so the save has no ``mtp.*``: a warning, and a model without them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from structlog.testing import capture_logs

from bench.harness import NEMO_DIR
from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.engram_vocab import engram_token_map_of
from deepinfer.checkpoint.hub import resolve_model
from deepinfer.checkpoint.loader_v41 import CheckpointError, load_v41_checkpoint
from deepinfer.checkpoint.mtp import has_mtp
from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.ops import get_ops

ATOL = 1e-4  # |Δ logprob| over the full vocabulary, fp32 on both sides, NeMo under reference_rules
CASES = {"sketch": False, "mixed": True, "heads8": False}  # config name → with a vision tower


@pytest.fixture(scope="module")
def nemo() -> None:
    from deepinfer.checkpoint.references import NemoUnavailable, nemo_v41_modules

    try:
        nemo_v41_modules(NEMO_DIR)
    except NemoUnavailable as e:
        pytest.fail(f"these tests need NeMo AutoModel 0.7.0: {e}", pytrace=False)


@pytest.fixture(scope="module")
def tokenizer():
    from models.tiny_v41 import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, nemo, tokenizer, tmp_path_factory) -> tuple[str, object, DeepseekV41Model, Path]:
    """(config name, NeMo's model, ours with its weights copied by the parity helper, the folder NeMo's
    save_pretrained wrote)."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    import models.nemo_v41 as helper

    backend = dataclasses.replace(helper.nemo_backend(), enable_hf_state_dict_adapter=True)
    with pytest.MonkeyPatch.context() as mp:  # NeMo then builds its own DeepseekV41StateDictAdapter
        mp.setattr(helper, "nemo_backend", lambda: backend)
        theirs, copied = helper.build_pair(request.param, tokenizer, seed=1, vision=CASES[request.param])
    assert theirs.state_dict_adapter is not None
    root = tmp_path_factory.mktemp("nemo_saved") / request.param
    checkpointer = Checkpointer(CheckpointingConfig(checkpoint_dir=str(root), save_consolidated="final"), 0, 0, 0)
    theirs.save_pretrained(str(root), checkpointer=checkpointer, tokenizer=tokenizer, is_final_checkpoint=True)
    return request.param, theirs, copied, root


def load(path: Path) -> DeepseekV41Model:
    with open(path / "config.json", encoding="utf-8") as f:
        config = DeepseekV41Config.from_dict(json.load(f))
    with torch.device("meta"):  # as the engine builds it: nothing allocated until the loader fills it
        model = DeepseekV41Model(config, get_ops("cpu"), engram_token_map_of(path)[0])
    load_v41_checkpoint(model, path, torch.float32)
    model.set_quant_sim(False)
    return model


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (1, 17, 41)]


def test_save_is_found_and_has_released_names(saved: tuple, tokenizer) -> None:
    """``resolve_model`` on NeMo's checkpoint folder gives its consolidated export; its config.json (transformers 5
    writes ``rope_parameters``, not ``rope_scaling``) parses to the config NeMo was built from; its names are the
    released ones, unquantized, without ``mtp.*``."""
    from models.nemo_v41 import composite

    name, _, _, root = saved
    path = resolve_model(root, None)
    assert path == root / "model" / "consolidated"
    with open(path / "config.json", encoding="utf-8") as f:
        written = DeepseekV41Config.from_dict(json.load(f))
    assert written == DeepseekV41Config.from_dict(composite(name, tokenizer, CASES[name]))
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            names |= set(h.keys())
    assert {"embed.weight", "head.weight", "layers.0.hc_attn_fn", "layers.0.ffn.experts.0.w1.weight"} <= names
    assert not any(n.startswith("mtp.") or n.endswith(".scale") for n in names)


def test_weights_equal_nemo_and_no_dspark(saved: tuple) -> None:
    _, _, copied, root = saved
    with capture_logs() as logs:
        model = load(root / "model" / "consolidated")
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "checkpoint has no MTP block: speculative decoding is off for this model"
    ]
    assert model.text.num_nextn_predict_layers > 0 and model.mtp is None and not has_mtp(model) and has_mtp(copied)
    got = dict(model.named_parameters())
    want = {k: v for k, v in copied.named_parameters() if not k.startswith("mtp.")}
    assert set(got) == set(want)
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k


def test_logits_match_nemo(saved: tuple) -> None:
    from models.nemo_v41 import nemo_logits, reference_rules

    _, theirs, _, root = saved
    model = load(root / "model" / "consolidated")
    worst = 0.0
    for p in prompts(model.text.vocab_size):
        cache = PagedKVCache(model.config, 16, 8)
        batch = ForwardBatch.build([SeqChunk(SequenceState(), 0, len(p), torch.arange(16))], [p])
        ours = model.logits(model(batch, cache)).log_softmax(-1)
        with reference_rules():
            ref = nemo_logits(theirs, torch.tensor([p]))[0].log_softmax(-1)
        worst = max(worst, float((ours - ref).abs().max()))
    assert worst <= ATOL, f"max |Δ logprob| = {worst:.3g}"


@pytest.mark.parametrize("saved", ["sketch"], indirect=True)
def test_engine_serves_a_nemo_save(saved: tuple) -> None:
    """``LLM`` on NeMo's checkpoint folder (not the consolidated one: the hub finds it)."""
    from models.nemo_v41 import nemo_logits, reference_rules

    _, theirs, _, root = saved
    llm = LLM(model=root, dtype="float32", num_pages=64, page_size=8, quant_sim=False)
    assert not has_mtp(llm.model)
    ps = prompts(llm.config.text_config.vocab_size)[1:]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=1, prompt_logprobs=3))
    worst = 0.0
    for p, out in zip(ps, outs):
        with reference_rules():
            ref = nemo_logits(theirs, torch.tensor([p]))[0].log_softmax(-1)
        for i in range(1, len(p)):
            worst = max(worst, *(abs(lp - float(ref[i - 1, t])) for t, lp in out.prompt_logprobs[i].items()))
    assert worst <= ATOL, f"max |Δ logprob| = {worst:.3g}"


@pytest.mark.parametrize("saved", ["sketch"], indirect=True)
def test_other_missing_tensor_is_still_an_error(saved: tuple, tmp_path: Path) -> None:
    """Without ``mtp.*`` and without one backbone tensor: the error names the backbone tensor."""
    from safetensors.torch import load_file, save_file

    _, _, _, root = saved
    src = root / "model" / "consolidated"
    dest = tmp_path / "bad"
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            tensors.pop("layers.2.attn.kv_norm.weight", None)
            save_file(tensors, str(dest / f.name), metadata={"format": "pt"})
        else:
            (dest / f.name).write_bytes(f.read_bytes())
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.2.attn.kv_norm.weight"]
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lacks \d+ tensors the model needs, e\.g\. layers\.2\.attn\.kv_norm"):
        load(dest)
