"""Metrics read from a service's state when Prometheus scrapes (collectors registered beside the counters of
``serving.metrics``): the scheduler's speculative-decoding and prefix-cache counters, a worker's EPLB."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from deepinfer.engine.prefix_cache import MISS_REASONS


class SpeculationCollector:
    """Speculative decoding (``Scheduler.spec``: ``engine.speculative.stats.SpecStats``), read at scrape time: vLLM's
    names (``vllm:spec_decode_*``) and the acceptance length, tokens emitted per verified sequence."""

    def __init__(self, scheduler: object, model: str) -> None:
        self.scheduler, self.model = scheduler, model

    def collect(self) -> Iterator[Metric]:
        s, m, labels = self.scheduler.spec, [self.model], ["model_name"]
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Verify rows run: a sequence's drafts verified in one step.", s.verifies),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", s.draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens kept (output tokens).", s.accepted_tokens),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(m, value)
            yield c
        off = CounterMetricFamily(
            "deepinfer_spec_decode_steps_off", "Steps planned without drafts, by reason: batch (more decode rows than "
            "DEEPINFER_SPEC_DECODE_MAX_BATCH), cost (plain steps measured cheaper per token).",
            labels=["model_name", "reason"],
        )  # fmt: skip
        off.add_metric([self.model, "batch"], s.steps_off_batch)
        off.add_metric([self.model, "cost"], s.steps_off_cost)
        yield off
        tpot = GaugeMetricFamily(
            "deepinfer_spec_decode_seconds_per_token", "Measured seconds per output token of one sequence, by decode "
            "batch bucket and by whether the steps drafted (what decides whether a step drafts).",
            labels=["model_name", "batch", "drafts"],
        )  # fmt: skip
        for (b, drafted), est in sorted(self.scheduler.spec_policy.estimates.items()):
            tpot.add_metric([self.model, str(b), "on" if drafted else "off"], est.seconds_per_token)
        yield tpot
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept, by their position among the drafts.",
            labels=["model_name", "position"],
        )  # fmt: skip
        for pos in sorted(s.accepted_per_pos):
            per_pos.add_metric([self.model, str(pos)], s.accepted_per_pos[pos])
        yield per_pos
        lengths = HistogramMetricFamily(
            "deepinfer_spec_decode_acceptance_length", "Tokens a verified sequence emitted in one step (kept drafts "
            "+ 1).", labels=labels,
        )  # fmt: skip
        top = max(getattr(self.scheduler.config, "num_speculative_tokens", 0) + 1, max(s.emitted, default=1))
        cumulative, buckets = 0, []
        for n in range(1, top + 1):
            cumulative += s.emitted.get(n, 0)
            buckets.append((str(float(n)), cumulative))
        buckets.append(("+Inf", cumulative))
        lengths.add_metric(m, buckets, sum_value=sum(n * k for n, k in s.emitted.items()))
        yield lengths


class PrefixCacheCollector:
    """The scheduler's prefix-cache counters, read at scrape time (vLLM names where vLLM has one)."""

    def __init__(self, scheduler: object, model: str) -> None:
        self.scheduler, self.model = scheduler, model

    def collect(self) -> Iterator[Metric]:
        s, m = self.scheduler, [self.model]
        q = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                labels=["model_name"])  # fmt: skip
        q.add_metric(m, s.prefix_queries)
        h = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                labels=["model_name"])  # fmt: skip
        h.add_metric(m, s.prefix_hits)
        miss = CounterMetricFamily(
            "deepinfer_prefix_cache_misses", "Requests no resume point served, by reason.",
            labels=["model_name", "reason"],
        )  # fmt: skip
        for reason in MISS_REASONS:
            miss.add_metric([self.model, reason], s.prefix_misses.get(reason, 0))
        rps = GaugeMetricFamily("deepinfer_prefix_cache_resume_points", "Resume points held (device tier).",
                                labels=["model_name"])  # fmt: skip
        rps.add_metric(m, s.num_resume_points)
        yield from (q, h, miss, rps)


class CurrentBalancer:
    """The EPLB balancer (``parallel.expert_balancer.ExpertBalancer``) of the model a worker of several ranks runs
    now (``servicer``: its ``serving.worker.WorkerService``), for its reporters and its metrics: the counts start
    again with each model (LoadModel), none while one loads."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    def _now(self) -> Any:
        parts = self.servicer.parts
        return None if parts is None else getattr(parts.runner, "balancer", None)

    @property
    def world(self) -> int:
        return self.servicer.processes

    @property
    def rebalances(self) -> int:
        b = self._now()
        return 0 if b is None else b.rebalances

    @property
    def layers_moved(self) -> int:
        b = self._now()
        return 0 if b is None else b.layers_moved

    def take(self, rank: int) -> dict[int, list[int]]:
        b = self._now()
        return {} if b is None else b.take(rank)


class ExpertBalanceCollector:
    """EPLB in a worker of several ranks (``parallel.expert_balancer.ExpertBalancer``), read at scrape time."""

    def __init__(self, balancer: object, model: str) -> None:
        self.balancer, self.model = balancer, model

    def collect(self) -> Iterator[Metric]:
        b, m = self.balancer, [self.model]
        for name, doc, value in (
            ("deepinfer_eplb_rebalances", "EPLB rounds run: the ranks' expert loads gathered and a move decided.",
             b.rebalances),
            ("deepinfer_eplb_layers_moved", "MoE layers whose experts EPLB re-placed.", b.layers_moved),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c


__all__ = ["CurrentBalancer", "ExpertBalanceCollector", "PrefixCacheCollector", "SpeculationCollector"]
