"""The engine's step length from a latency histogram read twice (policy.steps)."""

from __future__ import annotations

import math

import pytest

from policy import step_seconds, window_counts

INF = math.inf


def test_window_counts_are_the_observations_between_two_readings() -> None:
    before = [(0.1, 5.0), (1.0, 6.0), (INF, 6.0)]
    after = [(0.1, 25.0), (1.0, 26.0), (INF, 28.0)]
    assert window_counts(before, after) == [(0.0, 0.1, 20.0), (0.1, 1.0, 0.0), (1.0, INF, 2.0)]
    assert window_counts(None, after) == [(0.0, 0.1, 25.0), (0.1, 1.0, 1.0), (1.0, INF, 2.0)]
    assert window_counts(after, before) == []  # went back: an engine restart
    assert window_counts([(0.5, 1.0), (INF, 1.0)], after) == []  # other buckets


def test_the_step_a_touch_meets_is_weighted_by_time() -> None:
    """Twenty 50 ms decode steps and one 2 s prefill step: by count the step is short, but two
    thirds of the time goes to the long one, and that is what a touch arriving at random meets."""
    counts = [(0.0, 0.1, 20.0), (0.1, 1.0, 0.0), (1.0, 2.5, 1.0), (2.5, INF, 0.0)]
    long = step_seconds(counts)
    assert long is not None and 1.0 < long <= 2.5
    assert step_seconds(counts, q=0.2) == pytest.approx(0.1 * 0.2 * 2.75 / 1.0, rel=1e-9)


def test_no_observations_and_the_open_last_bucket() -> None:
    assert step_seconds([]) is None
    assert step_seconds([(0.0, 0.1, 0.0), (0.1, INF, 0.0)]) is None
    only_open = step_seconds([(0.0, 5.0, 0.0), (5.0, INF, 3.0)], q=1.0)
    assert only_open == pytest.approx(10.0)  # counted as twice its low bound
