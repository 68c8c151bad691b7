"""The engine knows a model through its family (``engine/model_api.py``), looked up by ``model_type``
(``engine/models.py``): both DeepSeek families are found, an unknown type is refused naming the known ones, and a third
model — a toy LM with its own state, cache and resume points, registered here — serves through ``LLM`` like V4 does
(greedy outputs as its rule says, prefix-cache resumes included)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace

import pytest
import torch
from safetensors.torch import load, save
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.engine import models
from deepinfer.models.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

TOY = "toy_lm"


def test_both_deepseek_families_are_found_by_model_type():
    assert {"deepseek_v4", "deepseek_v41"} <= set(models.known_model_types())
    for model_type in ("deepseek_v4", "deepseek_v41"):
        family = models.family_for(model_type)
        assert family.model_type == model_type and family.decode_buckets
    assert models.family_for(None) is models.family_for("deepseek_v4")  # a config.json without a model_type
    assert models.model_type_of({"text_config": {"model_type": "x"}}) == "x"


def test_an_unknown_model_type_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="'llama'.*known: deepseek_v4, deepseek_v41"):
        models.family_for("llama")
    with pytest.raises(ValueError, match="'llama'"):
        models.parse_config({"model_type": "llama"})


# -- a third model: next token = (the sum of the sequence's tokens so far) % 1000 + 100 ---------------------------
@dataclass
class ToyConfig:
    vocab_size: int
    eos_token_id: int
    max_position_embeddings: int = 256
    model_type: str = TOY

    def min_replay(self) -> int:
        return 1


@dataclass
class ToyState:
    num_tokens: int = 0
    total: int = 0  # the sum of the tokens so far: the short-term state a resume point must carry


class ToyCache:
    """The token ids themselves, paged: what a compact resume point replays from."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str) -> None:
        self.page_size = page_size
        self.tokens = torch.zeros(num_pages + 1, page_size, dtype=torch.long, device=device)

    def bytes_per_page(self) -> int:
        return self.page_size * 8

    def read_pages(self, pages: torch.Tensor) -> dict:
        return {("tokens", 0): self.tokens[pages].clone()}

    def write_pages(self, pages: torch.Tensor, data: dict) -> None:
        self.tokens[pages] = data[("tokens", 0)].to(self.tokens.device)

    def token_sum(self, table: torch.Tensor, count: int) -> int:
        ps = self.page_size
        return sum(int(self.tokens[table[p // ps], p % ps]) for p in range(count))


@dataclass
class ToySnapshot:
    state: ToyState
    tail: torch.Tensor  # the partial page's tokens below ``position``
    compact: bool = False

    @property
    def position(self) -> int:
        return self.state.num_tokens

    def restore(self, cache: ToyCache, table: torch.Tensor, device: torch.device | str) -> ToyState:
        p, ps = self.position, cache.page_size
        if p % ps:
            cache.tokens[table[p // ps], : p % ps] = self.tail.to(cache.tokens.device)
        return replace(self.state)

    def restore_replay(self, cache: ToyCache, table: torch.Tensor, device: torch.device | str, start: int) -> ToyState:
        self.restore(cache, table, device)
        return ToyState(start, cache.token_sum(table, start))


class ToyBatch:
    def __init__(self, chunks: list, token_ids: list[list[int]], device: torch.device | str) -> None:
        self.chunks = chunks
        self.token_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=device)

    def offsets(self) -> list[tuple[int, int]]:
        out, o = [], 0
        for c in self.chunks:
            out.append((o, o + c[2]))
            o += c[2]
        return out

    def substitute(self, at: list[int], sources: list[tuple[torch.Tensor, int]]) -> None:
        for i, (src, row) in zip(at, sources):
            self.token_ids[i] = src[row]


class ToyLM(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, batch: ToyBatch, cache: ToyCache) -> torch.Tensor:
        ids, out = batch.token_ids.tolist(), []
        for (state, start, length, table, _), (a, b) in zip(batch.chunks, batch.offsets()):
            for j, tok in enumerate(ids[a:b]):
                p = start + j
                cache.tokens[table[p // cache.page_size], p % cache.page_size] = tok
                state.total += tok
                out.append(state.total % 1000 + 100)
            state.num_tokens += length
        return torch.tensor(out, dtype=torch.float32).unsqueeze(1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(hidden[:, 0].long(), self.config.vocab_size).float() * 20.0


class ToyFamily:
    model_type = TOY
    resume_layout = "toy-resume-v1"
    decode_buckets = ()

    def parse_config(self, raw: dict) -> ToyConfig:
        return ToyConfig(raw["vocab_size"], raw["eos_token_id"], raw.get("max_position_embeddings", 256))

    def build(self, path, config, ops, dtype, device, quant_sim) -> ToyLM:
        return ToyLM(config).to(device)

    def new_cache(self, config, num_pages, page_size, dtype, device) -> ToyCache:
        return ToyCache(num_pages, page_size, device)

    def new_state(self) -> ToyState:
        return ToyState()

    def take_snapshot(self, state: ToyState, cache: ToyCache, table: torch.Tensor, compact: bool) -> ToySnapshot:
        p, ps = state.num_tokens, cache.page_size
        tail = cache.tokens[table[p // ps], : p % ps].clone() if p % ps else torch.zeros(0, dtype=torch.long)
        return ToySnapshot(ToyState(p, 0 if compact else state.total), tail, compact)

    def encode_resume(self, snapshot: ToySnapshot, pages: dict) -> bytes:
        meta = {
            "position": str(snapshot.position),
            "total": str(snapshot.state.total),
            "compact": str(snapshot.compact),
        }
        return save({"tail": snapshot.tail, "pages": pages[("tokens", 0)]}, metadata=meta)

    def decode_resume(self, data: bytes) -> tuple[ToySnapshot, dict]:
        t, meta = load(data), json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        state = ToyState(int(meta["position"]), int(meta["total"]))
        return ToySnapshot(state, t["tail"], meta["compact"] == "True"), {("tokens", 0): t["pages"]}

    def batch(self, chunks, token_ids, device) -> ToyBatch:
        return ToyBatch(list(chunks), token_ids, device)

    def fingerprint_facts(self, model: ToyLM) -> list[str]:
        return []


def _expected(prompt: list[int], n: int) -> list[int]:
    total, out = sum(prompt), []
    for _ in range(n):
        out.append(total % 1000 + 100)
        total += out[-1]
    return out


@pytest.fixture
def toy_dir(tmp_path):
    tiny = make_tiny_model(tmp_path / "tiny", seed=0)  # for its tokenizer
    path = tmp_path / "toy"
    path.mkdir()
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, path / f.name)
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    (path / "config.json").write_text(json.dumps({"model_type": TOY, "vocab_size": vocab, "eos_token_id": 1}))
    models.register(ToyFamily())
    yield path
    models.unregister(TOY)


def test_a_third_model_family_plugs_in(toy_dir):
    assert TOY not in FAMILIES and TOY in models.known_model_types()
    llm = LLM(toy_dir, accelerator="cpu", num_pages=32, page_size=4, max_model_len=128, enable_prefix_caching=True)
    assert isinstance(llm.model, ToyLM) and isinstance(llm.engine.runner.cache, ToyCache)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for _ in range(2):  # the second round resumes the shared prefixes from the first's resume points
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == [_expected(p, 6) for p in prompts]
    assert any(o.num_cached_tokens for o in outs)
