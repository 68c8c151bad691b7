"""A ``torch.profiler`` record of some of a worker's steps, for a reader who asks where a step's time goes in the
service (``DEEPINFER_TORCH_PROFILER_DIR``; vLLM's ``VLLM_TORCH_PROFILER_DIR`` serves the same purpose).

The worker's step thread counts the steps it launches that run tokens; after the first
``DEEPINFER_PROFILE_SKIP_STEPS`` of them it records the next ``DEEPINFER_PROFILE_STEPS`` (the host's operators, and
the accelerator's kernels where the profiler sees them: CUDA), then waits for the device to finish them and writes
two files into the directory, named after the worker, its process and the steps (first and last, counted from 0):
``<name>-<pid>-steps-<a>-<b>.json``, a Chrome trace (Perfetto, ``chrome://tracing``), and ``.txt``, the operators
by total time. A worker records once in its life; a stream that ends before the count is reached writes what it
recorded. The records cost host time while they run (figures from those steps are not the service's): for
benchmarks of the mesh, not for production. A record that cannot start or be written is logged and given up: the
steps go on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import structlog
import torch

from deepinfer.runtime.platform import platform_of

log = structlog.get_logger(__name__)


class StepProfiler:
    """Records steps ``skip .. skip + count`` (counted from 0, steps with tokens only) into ``directory`` (None:
    never)."""

    def __init__(self, directory: str | os.PathLike | None, skip: int, count: int, name: str,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.dir = Path(directory) if directory else None
        self.device = torch.device(device)
        self.platform = platform_of(self.device)
        self.skip, self.count = skip, count
        self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "worker"
        self.seen = 0  # steps with tokens launched
        self.first = 0  # the step the record began at
        self.prof: Any = None
        self.written: list[Path] = []
        self.done = self.dir is None or count <= 0

    def before(self, num_tokens: int) -> None:
        """A step with ``num_tokens`` tokens is about to launch (the step thread)."""
        if self.done or num_tokens <= 0 or self.prof is not None or self.seen < self.skip:
            return
        activities = self.platform.profiler_activities()
        try:
            prof = torch.profiler.profile(activities=activities, record_shapes=True)
            prof.__enter__()
        except Exception as e:  # noqa: BLE001 - a profiler that cannot start: the steps go on unrecorded
            log.warning("profile_failed", error=f"{type(e).__name__}: {e}")
            self.done = True
            return
        self.prof, self.first = prof, self.seen

    def after(self, num_tokens: int) -> None:
        """That step was launched."""
        if self.done or num_tokens <= 0:
            return
        self.seen += 1
        if self.prof is not None and self.seen >= self.first + self.count:
            self.stop()

    def stop(self) -> None:
        """End the record, if one runs, and write it; nothing more is recorded then."""
        if self.prof is None:
            return
        prof, self.prof, self.done = self.prof, None, True
        base = self.dir / f"{self.name}-{os.getpid()}-steps-{self.first}-{self.seen - 1}"
        try:
            self.platform.synchronize(self.device)  # the steps' kernels are in the record
            prof.__exit__(None, None, None)
            self.dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(base.with_suffix(".json")))
            device = len(self.platform.profiler_activities()) > 1  # (the device's kernels recorded)
            key = "self_device_time_total" if device else "self_cpu_time_total"
            base.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=key, row_limit=60) + "\n")
        except Exception as e:  # noqa: BLE001 - an unwritable directory, a full disk: the steps go on
            log.warning("profile_failed", error=f"{type(e).__name__}: {e}", path=str(base))
            return
        self.written = [base.with_suffix(".json"), base.with_suffix(".txt")]
        log.info("steps_profiled", first=self.first, last=self.seen - 1, files=[str(p) for p in self.written])


__all__ = ["StepProfiler"]
