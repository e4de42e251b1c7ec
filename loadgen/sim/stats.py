"""The counters the simulated engine bumps on its hot path, and a latency histogram."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily, Metric

# vLLM's buckets for vllm:time_to_first_token_seconds (used for every latency histogram here)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Bucket counts and a sum of seconds, rendered as a Prometheus histogram."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        self.sum += seconds

    def render(self, name: str, doc: str, labels: dict[str, str]) -> Metric:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*TTFT_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        fam.add_metric(list(labels.values()), buckets, self.sum)
        return fam


@dataclass(slots=True)
class EngineStats:
    """Plain counters the engine bumps on its hot path; rendered only when scraped."""

    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    external_queries: int = 0
    external_hits: int = 0
    # wall seconds of modelled steps, and of the simulator's own processing time the modelled
    # clock could not absorb (EngineConfig.max_lag_s): the share by which it ran slow
    modelled_s: float = 0.0
    lag_s: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    # vLLM's request_prefill_time (first scheduling to first token) and inter-token latency
    prefill: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
