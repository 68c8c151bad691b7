"""DeepSeek-V4.1's encoder/decoder split (docs/deepseek_v41.md, "Encoder/decoder split and bounded decoder
replay"): exact prefill vs the bounded decoder replay.

Exact: the decoder layers see every prompt token, as in a plain forward. Bounded replay: the encoder runs on every
prompt token, the first decoder layer still publishes its compressed rows and index keys for all of them (so the
decoder's long-range memory is complete), and the decoder layers run only on the prompt's last ``R`` tokens,
their sliding windows truncated to that segment: approximate by design. The drift it costs is measured here
(printed with ``-s``) on random tiny configurations, on the last prompt position and on a greedy continuation.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v4.forward_batch import ForwardBatch, SeqChunk
from deepinfer.models.deepseek_v4.paged_cache import PagedKVCache
from deepinfer.models.deepseek_v4.state import SequenceState
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import compressed_token_map
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from models.tiny_v41 import build_tokenizer, text_config


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _model(tokenizer, name: str, seed: int = 0) -> DeepseekV41Model:
    raw = {"model_type": "deepseek_v41", "text_config": text_config(name, tokenizer),
           "vision_config": {"num_hidden_layers": 0}, "image_token_id": 3}  # fmt: skip
    torch.manual_seed(seed)
    m = DeepseekV41Model(DeepseekV41Config.from_dict(raw), engram_token_map=compressed_token_map(tokenizer)[0])
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("norm.weight", "q_weight", "k_weight")):
                p.fill_(1.0)
            elif n.endswith(("hc_attn.scale", "hc_ffn.scale")):
                p.uniform_(0.5, 1.5)
            elif p.dim() == 1 or n.endswith(".fn"):
                p.normal_(0, 0.3)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    return m.eval()


class Seq:
    def __init__(self, model: DeepseekV41Model) -> None:
        self.model, self.state = model, SequenceState()
        self.cache = PagedKVCache(model.config, 16, 8)
        self.table = torch.arange(16)

    def feed(self, ids: list[int], decoder_from: int | None = None) -> torch.Tensor:
        chunk = SeqChunk(self.state, self.state.num_tokens, len(ids), self.table, decoder_from=decoder_from)
        return self.model.logits(self.model(ForwardBatch.build([chunk], [ids]), self.cache))


def _prompt(tokenizer, n: int, seed: int) -> list[int]:
    return torch.randint(5, len(tokenizer), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(seq: Seq, last: torch.Tensor, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(last[-1].argmax()))
        last = seq.feed(out[-1:])
    return out


@pytest.mark.parametrize("name", ["sketch", "heads8"])
def test_v41_decoder_split_without_skipped_rows_is_exact(tokenizer, name):
    """decoder_from at or before the chunk start (or None) changes nothing, bit for bit."""
    m = _model(tokenizer, name)
    ids = _prompt(tokenizer, 23, 1)
    ref = Seq(m).feed(ids)
    for d in (None, 0):
        assert torch.equal(Seq(m).feed(ids, decoder_from=d), ref)
    s = Seq(m)
    a, b = s.feed(ids[:10]), s.feed(ids[10:], decoder_from=5)
    torch.testing.assert_close(torch.cat([a, b]), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["sketch", "heads8"])
def test_v41_bounded_decoder_replay_drift(tokenizer, name):
    """Prompt of 40 tokens (window 4): replay the decoder over the last R tokens. The global rows equal the exact
    run's; the drift of the last position's logprobs and of a 16-token greedy continuation is printed; R covering
    the whole prompt is exact; and chunking the bounded prefill does not change it."""
    m = _model(tokenizer, name)
    ids = _prompt(tokenizer, 40, 2)
    exact = Seq(m)
    ref_last = exact.feed(ids)[-1:]
    ref_cont = _greedy(exact, ref_last, 16)
    win = m.text.sliding_window
    owner = m.decoder_start
    lines = []
    for r in (1, win, win + 12, 2 * win + 12, 40):
        s = Seq(m)
        logits = s.feed(ids, decoder_from=len(ids) - r)
        assert not bool(logits[: len(ids) - r].any()), "skipped positions produce no output"
        drift = float((logits[-1:].log_softmax(-1) - ref_last.log_softmax(-1)).abs().max())
        for kind in ("rows", "index"):  # the decoder's long-range memory is complete and exact
            torch.testing.assert_close(
                s.cache.read(kind, owner, s.table, len(ids) // m.text.compress_ratios[owner]),
                exact.cache.read(kind, owner, exact.table, len(ids) // m.text.compress_ratios[owner]),
                rtol=0,
                atol=1e-6,
            )
        cont = _greedy(s, logits[-1:], 16)
        agree = sum(a == b for a, b in zip(cont, ref_cont)) / 16
        lines.append(f"R={r:>2}: last-position max|Δ logprob| {drift:.3e}, greedy agreement {agree:.2f}")
        if r == len(ids):
            assert drift < 1e-5 and cont == ref_cont
        if r == win + 12:  # the same replay fed in 3 chunks
            c = Seq(m)
            parts = [c.feed(ids[a:b], decoder_from=len(ids) - r) for a, b in ((0, 17), (17, 31), (31, 40))]
            torch.testing.assert_close(torch.cat(parts)[-1:], logits[-1:], rtol=0, atol=1e-5)
    print(f"\n{name} (window {win}, decoder layers {owner}..{m.text.num_hidden_layers - 1}):\n  " + "\n  ".join(lines))


def test_v41_bounded_replay_refuses_decoder_kv_sources_past_the_boundary(tokenizer):
    """'mixed' has a KV source (layer 7) inside the decoder: skipping rows there would lose its global rows."""
    m = _model(tokenizer, "mixed")
    with pytest.raises(ValueError, match="every decoder KV source"):
        Seq(m).feed(_prompt(tokenizer, 12, 3), decoder_from=6)
