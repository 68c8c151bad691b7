"""The scheduler's settings (``SchedulerConfig``), read by the scheduler and its prefix-cache half
(``engine.scheduler``, ``engine.prefix_scheduling``), and how a server fills them from the env registry."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer import envs


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_model_len: int
    eos_token_id: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_caching: bool = True
    max_resume_points: int = 256
    resume_interval: int = 0  # also keep resume points every this many tokens (a multiple of page_size; 0: off)
    fingerprint: str = ""  # the model (weights, dtype, page size): part of every prefix hash
    remote_store: bool = False  # the worker moves resume points to and from a kvstore
    compact_replay: int = 0  # > 0: compact resume points, a hit replays this many tokens (approximate)
    decoder_replay: int = 0  # > 0: V4.1's decoder layers see only each prompt's last this many tokens (approximate)
    num_speculative_tokens: int = 0  # drafts a decode row may verify per step (the worker's drafter; 0: off)
    spec_max_batch: int = 32  # no drafts in a step with more decode rows than this
    spec_explore: int = 64  # steps between measurements of the other mode (engine.speculative.policy; 0: always draft)

    def __post_init__(self) -> None:
        for name in ("page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.resume_interval < 0 or self.resume_interval % self.page_size:
            raise ValueError(f"resume_interval must be a multiple of page_size, got {self.resume_interval}")
        if self.decoder_replay < 0:
            raise ValueError(f"decoder_replay must be >= 0, got {self.decoder_replay}")
        if self.num_speculative_tokens < 0 or self.spec_max_batch <= 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 and spec_max_batch > 0, got "
                             f"{self.num_speculative_tokens}, {self.spec_max_batch}")  # fmt: skip


def config_from_env(
    page_size: int,
    max_model_len: int,
    eos_token_id: int,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    fingerprint: str = "",
    prefix_caching: bool | None = None,
    remote_store: bool = False,
    num_speculative_tokens: int = 0,
) -> SchedulerConfig:
    """The scheduler's settings: the arguments where given, else the env registry's. ``num_speculative_tokens``: what
    the worker drafts (its ``DEEPINFER_USE_NEXTN_DECODE``, which it reports)."""
    return SchedulerConfig(
        page_size=page_size,
        max_model_len=max_model_len,
        eos_token_id=eos_token_id,
        max_num_seqs=max_num_seqs or envs.DEEPINFER_MAX_NUM_SEQS,
        max_num_batched_tokens=max_num_batched_tokens or envs.DEEPINFER_MAX_NUM_BATCHED_TOKENS,
        prefix_caching=envs.DEEPINFER_ENABLE_PREFIX_CACHING if prefix_caching is None else prefix_caching,
        max_resume_points=envs.DEEPINFER_PREFIX_CACHE_RESUME_POINTS,
        resume_interval=envs.DEEPINFER_RESUME_INTERVAL,
        fingerprint=fingerprint,
        remote_store=remote_store,
        compact_replay=envs.DEEPINFER_COMPACT_REPLAY_TOKENS,
        decoder_replay=envs.DEEPINFER_DECODER_REPLAY_TOKENS,
        num_speculative_tokens=num_speculative_tokens,
        spec_max_batch=envs.DEEPINFER_SPEC_DECODE_MAX_BATCH,
        spec_explore=envs.DEEPINFER_SPEC_DECODE_EXPLORE_STEPS,
    )


__all__ = ["SchedulerConfig", "config_from_env"]
