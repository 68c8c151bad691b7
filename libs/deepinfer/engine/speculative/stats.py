"""What speculative decoding achieved, counted by the scheduler from its workers' results (exported by the scheduler
service as vLLM's ``vllm:spec_decode_*`` metrics: ``serving.collectors.SpeculationCollector``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    verifies: int = 0  # verify rows run (a sequence's drafts verified in one step): vLLM's "drafts"
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: Counter[int] = field(default_factory=Counter)  # draft position (0 = first) -> times kept
    emitted: Counter[int] = field(default_factory=Counter)  # tokens one verify row emitted (kept + 1) -> times
    steps_off_batch: int = 0  # steps planned without drafts: their decode batch was above the limit
    steps_off_cost: int = 0  # ... plain steps were measured cheaper per token (``engine.speculative.policy``)

    @property
    def steps_off(self) -> int:
        return self.steps_off_batch + self.steps_off_cost

    def record(self, drafts: int, kept: int) -> None:
        """One sequence's verify row: ``drafts`` verified, ``kept`` of them kept."""
        if drafts <= 0:
            return
        self.verifies += 1
        self.draft_tokens += drafts
        self.accepted_tokens += kept
        for j in range(kept):
            self.accepted_per_pos[j] += 1
        self.emitted[kept + 1] += 1


__all__ = ["SpecStats"]
