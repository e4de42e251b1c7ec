"""How retention earns its overhead credit from the engine's prefix-cache query counter."""

from __future__ import annotations

import pytest

from policy.overhead import OverheadBudget, OverheadConfig
from proxy.signals import EngineSignals
from tests.helpers.memory_engine import MemoryEngine


def engine_state() -> EngineSignals:
    es = EngineSignals("mem", MemoryEngine())
    es.overhead = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=10**9))
    es.overhead.credit = 0.0
    return es


def test_clients_traffic_earns_and_retentions_own_does_not() -> None:
    es = engine_state()
    es.earn(1_000.0)  # the first reading is the baseline
    assert es.overhead.credit == 0
    es.sent(500)  # a touch of 500 tokens sent, scheduled with 10,000 of clients'
    es.earn(11_500.0)
    assert es.overhead.credit == pytest.approx(100)  # 1% of the 10,000


def test_a_touch_counted_by_the_engine_a_reading_later_is_carried_not_forgiven() -> None:
    es = engine_state()
    es.earn(0.0)
    es.sent(8_000)  # sent now, scheduled after this reading
    es.earn(1_000.0)  # 1,000 of clients' tokens only
    assert es.overhead.credit == 0 and es.retention_sent == 7_000
    es.earn(10_000.0)  # the touch's 8,000 and 1,000 more of clients'
    assert es.overhead.credit == pytest.approx(20)  # 1% of the 2,000 clients' tokens in all
    assert es.retention_sent == 0


def test_a_counter_that_went_back_counts_from_zero() -> None:
    es = engine_state()
    es.earn(50_000.0)
    es.earn(3_000.0)  # the engine restarted
    assert es.overhead.credit == pytest.approx(30)
