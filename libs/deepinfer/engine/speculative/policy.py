"""Whether a step drafts, from what steps with and without drafts were measured to cost per token.

A verify step emits more tokens per sequence than a plain decode step and takes longer; which one gives the lower
time per output token depends on the batch, the model, the hardware and how often the drafts are right, so the
scheduler measures it instead of assuming it. Per decode-batch bucket (a power of two of decode rows) it keeps each
mode's last samples: the time between two consecutive step results (the rate at which the worker delivers steps
while there is work; an interval that began with no request to run is not counted) and the tokens the step emitted
per sequence. A mode's cost is their seconds over their tokens (``Estimate``), leaving out a step far slower than
the others (a compile, a hiccup of the host): not the median of per-step ratios, which at batch 1 sits on the steps
whose drafts were all rejected (40% of them with 40% of the drafts wrong) and called drafting dearer than plain
steps where it was 20% cheaper (H100, 2026-12-06). An interval in which the worker captured CUDA graphs
(``StepResult.graph_captures``: a new batch bucket or context span, met once) is not counted either, since the
capture's seconds are no step's cost and a few of them among a mode's first samples would decide it. A step takes
the cheaper mode; every ``explore`` steps of a bucket, times the ratio of the two modes' costs (a far dearer mode
then takes about the same share of the time; at most ``MAX_RATIO``), it runs a short burst of the other, whose
first result (the pipeline changing shape) is not counted either, so a change of acceptance or load is seen.
Until both modes are measured it drafts (speculation is on because it was asked for), then tries the plain steps.
Only steps of decode rows alone are measured (a prefill chunk's cost is not a token's).

``explore`` 0 turns the measuring off: every step under the batch limit drafts. ``clock``: injectable for tests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BURST = 4  # steps of the other mode per exploration (the first is not counted)
MIN_SAMPLES = 3  # samples of a mode before it is compared
WINDOW = 8  # the recent samples a mode's estimate is made of
SLOW = 4.0  # a sample whose interval is over this many times the window's median is left out of the estimate
MAX_RATIO = 16.0  # a far dearer mode is measured again at least every ``explore`` x this many steps


def bucket(rows: int) -> int:
    """The power of two at or above ``rows`` (the measurements' key)."""
    return 1 << max(rows - 1, 0).bit_length()


@dataclass
class Estimate:
    """A mode's seconds per token of one sequence over its last ``WINDOW`` samples (``recent``: each step's seconds,
    its interval times its rows, and the tokens it emitted): their seconds over their tokens, a step weighing as many
    tokens as it emitted, less the samples whose seconds are over ``SLOW`` times the window's median (a rare slow
    step: a compile, a hiccup of the host; CUDA graph captures are not sampled at all); ``samples``: all taken."""

    seconds: float  # the first sample's
    tokens: int
    samples: int = 1
    recent: list[tuple[float, int]] = field(default_factory=list)
    seconds_per_token: float = 0.0

    def __post_init__(self) -> None:
        self.recent = self.recent or [(self.seconds, self.tokens)]
        self._estimate()

    def add(self, seconds: float, tokens: int) -> None:
        self.recent = [*self.recent[-(WINDOW - 1) :], (seconds, tokens)]
        self.samples += 1
        self._estimate()

    def _estimate(self) -> None:
        slow = SLOW * statistics.median(t for t, _ in self.recent)
        kept = [(t, k) for t, k in self.recent if t <= slow]
        self.seconds_per_token = sum(t for t, _ in kept) / max(sum(k for _, k in kept), 1)


@dataclass
class SpecPolicy:
    explore: int = 64
    clock: Callable[[], float] = time.monotonic
    estimates: dict[tuple[int, bool], Estimate] = field(default_factory=dict)  # (bucket, drafts) -> seconds/token
    _since: dict[int, int] = field(default_factory=dict)  # bucket -> steps since its last exploration
    _burst: dict[int, tuple[bool, int]] = field(default_factory=dict)  # bucket -> (mode, steps left)
    _plans: dict[int, tuple[int, bool, int] | None] = field(default_factory=dict)  # step -> (rows, drafted, bucket)
    _mark: float = 0.0  # when the interval the next result closes began
    _in_flight: int = 0
    _counted: bool = False  # whether the next result's interval may be counted (work was waiting all along)
    _busy: bool = False  # whether requests were left to run at the last result
    _last_mode: bool | None = None
    chosen: int | None = None  # the bucket of this step's choice, until the step is sent (None: no choice)

    def choose(self, rows: int) -> bool:
        """Whether a step of ``rows`` decode rows drafts. A burst or an exploration counts its steps when they are
        sent with decode rows (``planned``): a step in which every row waits for a result does not use them up."""
        if self.explore <= 0:
            return True
        b = self.chosen = bucket(rows)
        burst = self._burst.get(b)
        if burst is not None:
            return burst[0]
        on, off = self.estimates.get((b, True)), self.estimates.get((b, False))
        if on is None or on.samples < MIN_SAMPLES:
            return True
        if off is None:  # drafting measured: try the plain steps
            self._burst[b] = (False, BURST)
            return False
        best = on.seconds_per_token <= off.seconds_per_token
        # the dearer the other mode, the less often it is measured again: a burst costs about the same share
        cheap, dear = sorted((on.seconds_per_token, off.seconds_per_token))
        if self._since.get(b, 0) >= self.explore * min(dear / max(cheap, 1e-12), MAX_RATIO):
            self._since[b] = 0
            self._burst[b] = (not best, BURST)
            return not best
        return best

    def planned(self, step_id: int, decode_rows: int, drafted: bool, decode_only: bool) -> None:
        """A step was sent: ``decode_rows`` decode rows, with drafts or not; ``decode_only``: no prefill chunk."""
        if self._in_flight == 0 and not self._busy:  # idle since the last result: the interval starts now
            self._mark, self._counted = self.clock(), False
        self._in_flight += 1
        b, self.chosen = self.chosen, None
        # measured under the bucket the choice was made for (the decode requests of the batch, the step's and those
        # in flight): a verify step keeps its requests out of the next plan, so a batch may run as two steps
        # of half the rows, and the choice must find the cost measured for its own key
        key = bucket(decode_rows) if b is None else b
        self._plans[step_id] = (decode_rows, drafted, key) if decode_only and decode_rows else None
        if b is None or not decode_rows:
            return
        burst = self._burst.get(b)
        if burst is None:
            self._since[b] = self._since.get(b, 0) + 1
        elif burst[1] > 1:
            self._burst[b] = (burst[0], burst[1] - 1)
        else:
            del self._burst[b]

    def observed(self, step_id: int, tokens: int, busy: bool = True, one_time: bool = False) -> None:
        """A step's result arrived: ``tokens`` output tokens emitted by its decode rows; ``busy``: requests are left
        to run (else the time until the next step is idle, not a step's cost); ``one_time``: the interval up to it
        holds one-time work (graph captures), not counted."""
        now = self.clock()
        self._in_flight, self._busy = max(0, self._in_flight - 1), busy
        interval, counted = now - self._mark, self._counted
        self._mark, self._counted = now, True
        info = self._plans.pop(step_id, None)
        if info is None:
            return
        rows, drafted, b = info
        switched, self._last_mode = self._last_mode is not None and drafted != self._last_mode, drafted
        if not counted or switched or one_time or tokens <= 0:
            return
        key = (b, drafted)  # (seconds per token of one sequence: the interval times the rows, over the tokens)
        est = self.estimates.get(key)
        if est is None:
            self.estimates[key] = Estimate(interval * rows, tokens)
        else:
            est.add(interval * rows, tokens)


__all__ = ["BURST", "MAX_RATIO", "MIN_SAMPLES", "SLOW", "WINDOW", "Estimate", "SpecPolicy", "bucket"]
