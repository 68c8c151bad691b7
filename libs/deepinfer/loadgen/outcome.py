"""One request's result as the client saw it (times in seconds on the client's monotonic clock)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Outcome:
    session: int
    turn: int
    start: float = 0.0  # when the request was sent
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served from a prefix cache (the usage's cached_tokens)
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # ... by where they were: device, kvstore
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first generated text
    itl: list[float] = field(default_factory=list)  # seconds between successive pieces of generated text
    latency: float = 0.0  # seconds from sending to the last byte
    text: str = ""  # the generated text (multi-turn sessions send it back as the assistant's message)
    _last: float = 0.0

    def begin(self) -> None:
        self.start = self._last = time.perf_counter()

    def piece(self, text: str) -> None:
        """A piece of generated text arrived now."""
        now = time.perf_counter()
        if not self.ttft:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self._last)
        self._last = now
        self.text += text

    def end(self, error: str = "") -> None:
        self.latency = time.perf_counter() - self.start
        self.ok, self.error = not error and self.ttft > 0, error or ("" if self.ttft > 0 else "no output")

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (``vllm bench serve``'s TPOT); None with one token or fewer."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


__all__ = ["Outcome"]
