"""Prometheus metrics, one registry per app (no globals). Session ids are never labels."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any, TypeVar

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

M = TypeVar("M", Counter, Gauge, Histogram)


def kvkeeper_version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare source tree)."""
    try:
        return metadata.version("kvkeeper")
    except metadata.PackageNotFoundError:
        return "0+unknown"


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Every kvkeeper metric, registered on a private registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        # process_* (CPU, memory, open fds, start time), python_info and python_gc_*, as the
        # default registry of prometheus_client would export them
        # with worker processes these stay per process; the rest is summed over the workers
        self._local = CollectorRegistry()
        for collector in (ProcessCollector(registry=r), PlatformCollector(registry=r)):
            self._local.register(collector)
        r.register(GC_COLLECTOR)
        self._local.register(GC_COLLECTOR)
        self.build_info = Info("kvkeeper_build", "kvkeeper's version and Python", registry=r)
        self._local.register(self.build_info)
        self.build_info.info({"version": kvkeeper_version(), "python": platform.python_version()})
        self.redis_up = Gauge(
            "kvkeeper_redis_up",
            "Session store reachable (1) or not (0), from the last ping or store call",
            multiprocess_mode="livemin",
            registry=r,
        )
        self.hash_check = Gauge(
            "kvkeeper_hash_check",
            "Block-hash self-check per engine: 1 kvkeeper's hashes match the engine's KV "
            "events, 0 mismatch (residency tracking off, feedback mode), -1 not checked yet",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.requests = Counter(
            "kvkeeper_requests",
            "Proxied requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.hints = Counter("kvkeeper_hints", "Hints received by dialect", ["dialect"], registry=r)
        self.hint_outcomes = Counter(
            "kvkeeper_hint_outcomes", "Hint outcomes", ["outcome", "reason"], registry=r
        )
        self.edits = Counter(
            "kvkeeper_edits", "Context edits by type and outcome", ["type", "outcome"], registry=r
        )
        self.sessions_created = Counter("kvkeeper_sessions_created", "Sessions created", registry=r)
        self.sessions_freed = Counter(
            "kvkeeper_sessions_freed", "Sessions freed", ["how"], registry=r
        )
        self.upstream_latency = Histogram(
            "kvkeeper_upstream_latency_seconds",
            "Time from forwarding to the engine's full response",
            ["route", "engine"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvkeeper_ttft_seconds",
            "Time to first byte of the engine's response, seen at the proxy",
            ["route", "engine"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvkeeper_prompt_tokens", "Prompt tokens reported by engines", registry=r
        )
        self.cached_tokens = Counter(
            "kvkeeper_cached_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.admission_slack = Histogram(
            "kvkeeper_admission_slack_seconds",
            "Slack of the admission priority stamped on forwarded requests (the engine "
            "priority less the send time; admission.enabled)",
            buckets=(-1.0, 0.0, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0),
            registry=r,
        )
        self.engine_requests = Counter(
            "kvkeeper_engine_requests", "Requests forwarded, by engine", ["engine"], registry=r
        )
        # per engine, for the console's time series (proxy/console.py)
        self.engine_ttft = Histogram(
            "kvkeeper_engine_ttft_seconds",
            "Time to first byte of the engine's response, by engine",
            ["engine"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_prompt_tokens = Counter(
            "kvkeeper_engine_prompt_tokens",
            "Prompt tokens reported, by engine",
            ["engine"],
            registry=r,
        )
        self.engine_cached_tokens = Counter(
            "kvkeeper_engine_cached_tokens",
            "Prompt tokens served from the prefix cache, by engine",
            ["engine"],
            registry=r,
        )
        self.placements = Counter(
            "kvkeeper_placements",
            "Requests placed by their prompt, by engine and reason (prefix: the longest cached "
            "prefix; load: a match passed over for less queued work; spread: nothing cached)",
            ["engine", "reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvkeeper_upstream_errors", "Failed upstream attempts", ["engine", "kind"], registry=r
        )
        self.failovers = Counter(
            "kvkeeper_failovers", "Requests moved to another engine", registry=r
        )
        self.redis_errors = Counter(
            "kvkeeper_redis_errors", "Redis failures (data plane failed open)", registry=r
        )
        self.redis_stalls = Counter(
            "kvkeeper_redis_stalled_timeouts",
            "Redis calls timed out because this process's event loop stalled (Redis not held down)",
            registry=r,
        )
        self.fail_open = Counter(
            "kvkeeper_fail_open_requests", "Requests forwarded without session features", registry=r
        )
        self.completions_dropped = Counter(
            "kvkeeper_completions_dropped",
            "Finished requests whose usage could not be recorded (Redis down too long)",
            registry=r,
        )
        self.engine_up = Gauge(
            "kvkeeper_engine_up",
            "Engine health (1 up, 0 down)",
            ["engine"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.inflight = Gauge(
            "kvkeeper_inflight_requests",
            "Requests in flight per engine",
            ["engine"],
            multiprocess_mode="livesum",
            registry=r,
        )
        # retention (issue 4): touches and warm-ups and what they recomputed
        self.touches = Counter(
            "kvkeeper_touches", "Keep-alive touches sent", ["engine", "outcome"], registry=r
        )
        self.touch_prompt_tokens = Counter(
            "kvkeeper_touch_prompt_tokens", "Prompt tokens sent by touches", registry=r
        )
        self.touch_recomputed_tokens = Counter(
            "kvkeeper_touch_recomputed_tokens",
            "Prompt tokens touches recomputed (not cached)",
            registry=r,
        )
        self.warmup_prompt_tokens = Counter(
            "kvkeeper_warmup_prompt_tokens", "Prompt tokens sent by prefetch warm-ups", registry=r
        )
        self.warmup_recomputed_tokens = Counter(
            "kvkeeper_warmup_recomputed_tokens", "Prompt tokens warm-ups recomputed", registry=r
        )
        # the retention guard (policy/guard.py): retention's cost against the hits it bought
        self.guard_balance = Gauge(
            "kvkeeper_retention_guard_balance_tokens",
            "Hits retention bought less what it cost (recompute weighted by the queue, tier "
            "loads), decaying; below zero with enough evidence the guard backs off",
            ["engine"],
            registry=r,
        )
        self.guard_cost = Counter(
            "kvkeeper_retention_guard_cost_tokens",
            "Retention's weighted cost on the engine (recompute x (1 + queue), tier loads)",
            ["engine"],
            registry=r,
        )
        self.guard_bought = Counter(
            "kvkeeper_retention_guard_bought_tokens",
            "Prompt tokens resumes hit that retention had kept for them, after a pause longer "
            "than the engine's LRU horizon (credited to the guard)",
            ["engine"],
            registry=r,
        )
        self.guard_within_horizon = Counter(
            "kvkeeper_retention_guard_within_horizon_tokens",
            "Prompt tokens resumes hit that retention had kept for them, after a pause shorter "
            "than the LRU horizon: plain LRU would have kept them too (not credited)",
            ["engine"],
            registry=r,
        )
        self.guard_backed_off = Gauge(
            "kvkeeper_retention_guard_backed_off",
            "1 while the guard holds retention back on the engine (touches, warm-ups, new pins)",
            ["engine"],
            registry=r,
        )
        self.guard_backoffs = Counter(
            "kvkeeper_retention_guard_backoffs",
            "Times the guard backed retention off on the engine",
            ["engine"],
            registry=r,
        )
        self.overhead_credit = Gauge(
            "kvkeeper_retention_credit_tokens",
            "Recompute credit left to touches and warm-ups (retention.max_overhead_share)",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.kv_event_subscriptions = Gauge(
            "kvkeeper_kv_event_subscriptions",
            "KV-event subscriptions to the engine: 1 in the process holding its retention lease "
            "(summed over the workers: 1 per engine; the others apply its relay)",
            ["engine"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.horizon = Gauge(
            "kvkeeper_retention_horizon_seconds",
            "Estimated time an unused block survives in the engine's cache (+Inf: unknown yet)",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.offloads = Counter("kvkeeper_offloads", "Sessions offloaded to a tier", registry=r)
        self.long_retention = Counter(
            "kvkeeper_long_retention",
            "Retention beyond the GPU cap kept in the offload tier (proxy/longterm.py), by outcome",
            ["outcome"],
            registry=r,
        )
        self.tier_pinned_sessions = Gauge(
            "kvkeeper_tier_pinned_sessions",
            "Protected sessions pinned in the engine's offload tier",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.tier_pinned_chunks = Gauge(
            "kvkeeper_tier_pinned_chunks",
            "Chunks pinned in the engine's offload tier (shared chunks counted per pin)",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.prefetches = Counter("kvkeeper_prefetches", "Prefetch warm-ups run", registry=r)
        self.evictions = Counter("kvkeeper_evictions", "Sessions evicted by edits", registry=r)
        self.expiries = Counter("kvkeeper_expiries", "Session TTLs that expired", registry=r)
        self.pressure_overrides = Counter(
            "kvkeeper_pressure_overrides", "Protections lapsed by the soft-TTL budget", registry=r
        )
        self.return_protections = Counter(
            "kvkeeper_return_protections",
            "Sessions back without a TTL hint, protected for the learned return window",
            registry=r,
        )
        self.retention_tick = Histogram(
            "kvkeeper_retention_tick_seconds",
            "Wall time of one retention tick (the event loop is shared with the data plane)",
            ["engine"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.protected_sessions = Gauge(
            "kvkeeper_protected_sessions",
            "Sessions currently protected",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.protected_blocks = Gauge(
            "kvkeeper_protected_blocks",
            "Distinct blocks currently protected",
            ["engine"],
            multiprocess_mode="livemax",
            registry=r,
        )

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, remembered: the request path asks for the same few."""
        key = (metric, labels)  # a metric hashes by identity
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not folder:
            return generate_latest(self.registry)
        # worker processes (proxy/workers.py): every worker's values from the shared folder
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=folder)  # type: ignore[no-untyped-call]
        return generate_latest(merged) + generate_latest(self._local)
