"""The learned protection of sessions that return without a TTL hint (policy/returns.py)."""

from __future__ import annotations

import math

import pytest

from policy import ReturnWindow, ReturnWindowConfig


def test_nothing_until_enough_first_returns_then_factor_times_the_median() -> None:
    w = ReturnWindow(ReturnWindowConfig(factor=2.0, min_samples=3))
    for pause in (10.0, 30.0):
        w.observe(pause)
    assert w.ttl() is None  # two pauses: not learned yet
    w.observe(20.0)
    assert w.median() == 20.0 and w.ttl() == 40.0
    w.observe(40.0)  # even count: the mean of the middle two
    assert w.median() == 25.0 and w.ttl() == 50.0


def test_clamped_to_its_bounds_and_off_at_factor_zero() -> None:
    w = ReturnWindow(ReturnWindowConfig(factor=2.0, min_samples=1, min_ttl_s=5.0, max_ttl_s=60.0))
    w.observe(0.5)
    assert w.ttl() == 5.0
    for _ in range(3):
        w.observe(100.0)
    assert w.ttl() == 60.0
    off = ReturnWindow(ReturnWindowConfig(factor=0.0, min_samples=1))
    off.observe(10.0)
    assert off.ttl() is None


def test_only_the_latest_pauses_count_and_bad_ones_are_ignored() -> None:
    w = ReturnWindow(ReturnWindowConfig(factor=1.0, min_samples=2, max_samples=3))
    for pause in (1.0, 1.0, 1.0, 90.0, 90.0):
        w.observe(pause)
    assert w.samples == 3 and w.ttl() == 90.0  # the first two aged out
    for bad in (-1.0, math.nan, math.inf):
        w.observe(bad)
    assert w.samples == 3


@pytest.mark.parametrize(
    "kw",
    [
        {"factor": -1.0},
        {"factor": math.nan},
        {"min_samples": 0},
        {"min_samples": 5, "max_samples": 4},
        {"min_ttl_s": 0.0},
        {"min_ttl_s": 10.0, "max_ttl_s": 5.0},
    ],
)
def test_bad_config_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        ReturnWindowConfig(**kw)  # type: ignore[arg-type]
