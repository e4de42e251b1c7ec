"""LRU horizon estimation: weighted quantiles, sample minimums, windows, feedback mode."""

from __future__ import annotations

import math

import pytest

from policy.horizon import (
    HorizonConfig,
    HorizonEstimator,
    HorizonSource,
    weighted_quantile,
)

SAME_TIME = [(0.0, float(v)) for v in range(1, 11)]


@pytest.mark.parametrize(
    ("samples", "q", "now", "expected"),
    [
        (SAME_TIME, 0.1, 0.0, 1.0),
        (SAME_TIME, 0.5, 0.0, 5.0),
        (SAME_TIME, 0.0, 0.0, 1.0),
        (SAME_TIME, 1.0, 0.0, 10.0),
        ([], 0.1, 0.0, math.inf),
        # 5 old samples of 100 s (weight 0.25 each after two half-lives) + 1 fresh of 10 s:
        # total 2.25, q=0.4 -> target 0.9, the fresh sample alone reaches it.
        ([(0.0, 100.0)] * 5 + [(600.0, 10.0)], 0.4, 600.0, 10.0),
        # Without decay (all fresh) the same quantile lands on 100.
        ([(600.0, 100.0)] * 5 + [(600.0, 10.0)], 0.4, 600.0, 100.0),
    ],
)
def test_weighted_quantile(
    samples: list[tuple[float, float]], q: float, now: float, expected: float
) -> None:
    assert weighted_quantile(samples, q, now, half_life_s=300.0) == expected


def test_no_evictions_means_unknown_infinite_horizon() -> None:
    est = HorizonEstimator().estimate(now=123.0)
    assert est.source is HorizonSource.UNKNOWN
    assert est.seconds == math.inf
    assert not est.known


def test_few_samples_take_the_minimum() -> None:
    h = HorizonEstimator(HorizonConfig(min_samples=8))
    h.observe_evictions([20.0, 5.0, 30.0], at=100.0)
    est = h.estimate(now=100.0)
    assert (est.seconds, est.source, est.samples) == (5.0, HorizonSource.EVENTS, 3)


def test_many_samples_take_the_low_quantile() -> None:
    h = HorizonEstimator(HorizonConfig(quantile=0.1, min_samples=8))
    h.observe_evictions([float(a) for a in range(1, 101)], at=50.0)
    est = h.estimate(now=50.0)
    assert est.seconds == 10.0
    assert est.samples == 100


def test_window_keeps_only_recent_samples() -> None:
    h = HorizonEstimator(HorizonConfig(window=10, min_samples=8, quantile=0.1))
    for age in range(1, 21):
        h.observe_eviction(float(age), at=float(age))
    est = h.estimate(now=20.0)
    assert est.samples == 10
    assert est.seconds >= 11.0  # ages 1..10 were pushed out of the window


def test_one_long_removal_keeps_the_newest_valid_ages_as_single_observations_would() -> None:
    config = HorizonConfig(window=10, min_samples=8, quantile=0.1)
    ages = [float(a) for a in range(1, 31)] + [math.nan, -1.0]  # invalid ones at the end
    batched, single = HorizonEstimator(config), HorizonEstimator(config)
    batched.observe_evictions(iter(ages), at=5.0)  # any iterable, not only a sequence
    for age in ages:
        single.observe_eviction(age, at=5.0)
    assert batched.estimate(now=5.0) == single.estimate(now=5.0)
    assert batched.estimate(now=5.0).samples == 10 and batched.estimate(now=5.0).seconds == 21.0


def test_pressure_drop_follows_recent_samples() -> None:
    """Horizon was ~100 s; pressure rises and evictions now happen at ~10 s."""
    h = HorizonEstimator(HorizonConfig(half_life_s=60.0, min_samples=4, quantile=0.5))
    h.observe_evictions([100.0] * 20, at=0.0)
    h.observe_evictions([10.0] * 10, at=600.0)
    assert h.estimate(now=600.0).seconds == 10.0


def test_an_estimate_is_reused_until_a_sample_arrives_and_matches_a_fresh_one() -> None:
    """Decay scales every weight alike: past the newest sample, the quantile of the same
    samples is the same at any later ``now``; a new sample (or an earlier ``now``) recomputes."""
    config = HorizonConfig(half_life_s=60.0, min_samples=4, quantile=0.3)
    h = HorizonEstimator(config)
    h.observe_evictions([100.0] * 6, at=0.0)
    h.observe_evictions([10.0, 20.0, 30.0], at=120.0)
    samples = [(0.0, 100.0)] * 6 + [(120.0, 10.0), (120.0, 20.0), (120.0, 30.0)]
    first = h.estimate(now=120.0)
    for now in (121.0, 300.0, 3000.0):
        assert h.estimate(now) is first  # reused, not recomputed
        assert first.seconds == weighted_quantile(samples, 0.3, now, 60.0)
    h.observe_eviction(5.0, at=3000.0)  # a new sample: recomputed
    assert h.estimate(now=3000.0).seconds == weighted_quantile(
        [*samples, (3000.0, 5.0)], 0.3, 3000.0, 60.0
    )
    # before the newest sample (a clock set back) weights are clamped: computed afresh
    assert h.estimate(now=0.0).seconds == weighted_quantile(
        [*samples, (3000.0, 5.0)], 0.3, 0.0, 60.0
    )
    losses = HorizonEstimator(config)  # feedback mode alike
    for gap in (50.0, 40.0, 30.0, 20.0):
        losses.observe_resume(gap, 0, 16, at=10.0)
    fed = losses.estimate(now=10.0)
    assert fed.source is HorizonSource.FEEDBACK and losses.estimate(now=99.0) is fed
    losses.observe_resume(5.0, 0, 16, at=100.0)
    assert losses.estimate(now=100.0) is not fed


def test_invalid_ages_are_ignored() -> None:
    h = HorizonEstimator()
    h.observe_evictions([-1.0, math.nan, math.inf], at=0.0)
    assert h.estimate(now=0.0).source is HorizonSource.UNKNOWN


def test_feedback_mode_bounds_horizon_below_lost_gap() -> None:
    h = HorizonEstimator(HorizonConfig(min_samples=8))
    assert (
        h.observe_resume(gap_s=10.0, cached_tokens=2016, expected_cached_tokens=2016, at=1.0)
        is False
    )
    assert h.survivals == 1
    assert h.estimate(now=1.0).source is HorizonSource.UNKNOWN
    assert h.observe_resume(gap_s=40.0, cached_tokens=0, expected_cached_tokens=2016, at=2.0)
    assert h.observe_resume(gap_s=25.0, cached_tokens=992, expected_cached_tokens=2016, at=3.0)
    est = h.estimate(now=3.0)
    assert (est.seconds, est.source, est.samples) == (25.0, HorizonSource.FEEDBACK, 2)


def test_events_take_precedence_over_feedback() -> None:
    h = HorizonEstimator()
    h.observe_resume(gap_s=40.0, cached_tokens=0, expected_cached_tokens=64, at=0.0)
    h.observe_eviction(12.0, at=1.0)
    est = h.estimate(now=1.0)
    assert (est.seconds, est.source) == (12.0, HorizonSource.EVENTS)


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 0}, {"min_samples": 0}, {"quantile": 1.5}, {"half_life_s": 0.0}],
)
def test_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message names the field
        HorizonConfig(**kwargs)  # type: ignore[arg-type]


def test_rate_meter_window_has_no_warm_up_lag() -> None:
    from policy.horizon import RateMeter

    meter = RateMeter(window_s=5.0, min_span_s=1.0)
    assert meter.rate(0.0) == 0.0
    meter.add(63, 0.0)
    assert meter.rate(0.0) == 63.0  # one batch: spread over the minimum span, not ramped up
    for i in range(1, 21):  # 10 events every 0.5 s = 20/s
        meter.add(10, i * 0.5)
    assert meter.rate(10.0) == pytest.approx(20.0, rel=0.05)
    assert meter.rate(30.0) == 0.0  # nothing in the last window


@pytest.mark.parametrize(
    ("free", "rate", "expected"),
    [(200, 12.5, 16.0), (100, 0.0, math.inf), (0, 5.0, 0.0), (64, 64.0, 1.0)],
)
def test_fill_time_horizon(free: float, rate: float, expected: float) -> None:
    from policy.horizon import fill_time_horizon

    assert fill_time_horizon(free, rate) == expected
