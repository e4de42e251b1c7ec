"""How retention earns its overhead credit from the engine's prefix-cache query counter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from policy.overhead import OverheadBudget, OverheadConfig
from proxy.retention import Retention


def engine_state() -> Any:
    budget = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=10**9))
    budget.credit = 0.0
    return SimpleNamespace(overhead=budget, queries_seen=None, retention_sent=0)


def test_clients_traffic_earns_and_retentions_own_does_not() -> None:
    es = engine_state()
    Retention._earn(es, 1_000.0)  # the first reading is the baseline
    assert es.overhead.credit == 0
    es.retention_sent += 500  # a touch of 500 tokens sent, scheduled with 10,000 of clients'
    Retention._earn(es, 11_500.0)
    assert es.overhead.credit == pytest.approx(100)  # 1% of the 10,000


def test_a_touch_counted_by_the_engine_a_reading_later_is_carried_not_forgiven() -> None:
    es = engine_state()
    Retention._earn(es, 0.0)
    es.retention_sent += 8_000  # sent now, scheduled after this reading
    Retention._earn(es, 1_000.0)  # 1,000 of clients' tokens only
    assert es.overhead.credit == 0 and es.retention_sent == 7_000
    Retention._earn(es, 10_000.0)  # the touch's 8,000 and 1,000 more of clients'
    assert es.overhead.credit == pytest.approx(20)  # 1% of the 2,000 clients' tokens in all
    assert es.retention_sent == 0


def test_a_counter_that_went_back_counts_from_zero() -> None:
    es = engine_state()
    Retention._earn(es, 50_000.0)
    Retention._earn(es, 3_000.0)  # the engine restarted
    assert es.overhead.credit == pytest.approx(30)


def test_computed_token_rate_is_what_neither_cache_nor_tier_served() -> None:
    """``computed_rate``: prompt tokens queried less GPU and tier hits, per second, smoothed."""
    from adapters.base import EngineMetrics

    es = SimpleNamespace(computed_seen=None, computed_rate=None)

    def read(queries: float, hits: float, external: float, at: float) -> None:
        m = EngineMetrics(
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            external_prefix_cache_hits=external,
        )
        Retention._computed(es, m, at)  # type: ignore[arg-type]

    read(1_000, 400, 100, at=10.0)  # the baseline: 500 computed so far
    assert es.computed_rate is None
    read(5_500, 2_400, 600, at=12.0)  # 2,000 more computed in 2 s
    assert es.computed_rate == pytest.approx(1_000)
    read(5_500, 2_400, 600, at=14.0)  # idle: the mean halves
    assert es.computed_rate == pytest.approx(500)
    read(100, 0, 0, at=16.0)  # counters went back (a restart): a new baseline, rate kept
    assert es.computed_rate == pytest.approx(500) and es.computed_seen == (16.0, 100)


def test_step_length_from_the_inter_token_or_prefill_histogram() -> None:
    """``step_s``: from the inter-token histogram where requests decoded since the last scrape,
    else from the prefill-time one; smoothed. The touch deadline is ``touch_deadline_steps`` of
    it where that exceeds ``touch_deadline_s``."""
    from adapters.base import EngineMetrics, HistogramReading
    from proxy.settings import RetentionSettings

    es = SimpleNamespace(step_s=None, step_seen={})
    inf = float("inf")

    def hist(*cum: float) -> HistogramReading:  # buckets le 1, 2, 4, +Inf
        return HistogramReading(0.0, cum[-1], tuple(zip((1.0, 2.0, 4.0, inf), cum, strict=True)))

    def read(prefill: HistogramReading | None, itl: HistogramReading | None) -> None:
        Retention._steps(es, EngineMetrics(prefill_time=prefill, inter_token=itl))  # type: ignore[arg-type]

    read(hist(0, 0, 0, 0), None)  # the baseline
    assert es.step_s is None
    read(hist(0, 2, 2, 2), None)  # two one-token requests prefilled in 1-2 s each
    assert es.step_s == pytest.approx(1.9)  # 90% of the time, interpolated in (1, 2]
    read(hist(0, 2, 2, 2), hist(0, 0, 0, 0))  # nothing new; the inter-token baseline
    assert es.step_s == pytest.approx(1.9)
    # decodes now: the inter-token latencies decide (a prefill in chunks over 2-4 s is ignored)
    read(hist(0, 2, 3, 3), hist(4, 4, 4, 4))
    assert es.step_s == pytest.approx(0.5 * 1.9 + 0.5 * 0.9)
    read(hist(0, 0, 0, 0), hist(4, 4, 4, 4))  # went back (a restart): nothing learned, kept
    assert es.step_s == pytest.approx(1.4) and es.step_seen["prefill"][-1] == (inf, 0)

    deadline = Retention.touch_deadline
    assert RetentionSettings().touch_deadline_steps == 0  # off by default
    fast = SimpleNamespace(settings=RetentionSettings(touch_deadline_s=1.0, touch_deadline_steps=3))
    assert deadline(fast, SimpleNamespace(step_s=None)) == 1.0  # type: ignore[arg-type]
    assert deadline(fast, SimpleNamespace(step_s=0.02)) == 1.0  # type: ignore[arg-type]
    assert deadline(fast, SimpleNamespace(step_s=2.5)) == pytest.approx(7.5)  # type: ignore[arg-type]
    off = SimpleNamespace(settings=RetentionSettings(touch_deadline_s=1.0, touch_deadline_steps=0))
    assert deadline(off, SimpleNamespace(step_s=2.5)) == 1.0  # type: ignore[arg-type]
