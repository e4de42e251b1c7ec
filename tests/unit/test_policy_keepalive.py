"""Touch scheduling: due sessions, urgency order, concurrency, expiry, touch cost."""

from __future__ import annotations

import math

import pytest

from policy.keepalive import (
    KeepaliveConfig,
    ProtectedSession,
    expected_touch_rate,
    plan_touches,
    touch_cost_tokens,
    touch_extent,
    touch_interval,
)

NOW = 1000.0
HORIZON = 100.0  # safety 0.5 -> touch after 50 s idle


def S(
    sid: str, last: float, *, ttl: float = 5000.0, flight: bool = False, value: float = 1.0
) -> ProtectedSession:
    return ProtectedSession(sid, last, ttl, n_blocks=10, touch_in_flight=flight, value=value)


SESSIONS = [
    S("fresh", 980.0),  # age 20: due at 1030
    S("due", 940.0),  # age 60: due, savable
    S("older", 930.0, value=5.0),  # age 70: due, savable, more urgent
    S("expired", 900.0, ttl=999.0),
    S("flying", 800.0, flight=True),  # would be due, but a touch is in flight
    S("lost_cheap", 850.0, value=1.0),  # age 150 >= horizon
    S("lost_dear", 900.0, value=2.0),  # age 100 == horizon counts as lost
    S("due_after_ttl", 990.0, ttl=1020.0),  # due at 1040 > ttl: never needed
]


def test_plan_orders_savable_then_lost_and_caps_concurrency() -> None:
    plan = plan_touches(SESSIONS, HORIZON, NOW, KeepaliveConfig(max_concurrent_touches=3))
    # 3 slots minus the touch in flight = 2.
    assert plan.touch == ("older", "due")
    assert plan.deferred == ("lost_dear", "lost_cheap")
    assert plan.likely_lost == ("lost_dear", "lost_cheap")
    assert plan.expire == ("expired",)
    assert plan.next_due_at == 1030.0


@pytest.mark.parametrize("ttl", [5000.0, 999.0])
def test_in_flight_touches_can_take_every_slot(ttl: float) -> None:
    sessions = [S("a", 800.0, flight=True, ttl=ttl), S("b", 800.0)]
    plan = plan_touches(sessions, HORIZON, NOW, KeepaliveConfig(max_concurrent_touches=1))
    assert plan.touch == ()
    assert plan.deferred == ("b",)
    assert plan.expire == (() if ttl > NOW else ("a",))


@pytest.mark.parametrize(
    ("interval", "expected_touch"),
    [(None, ()), (30.0, ("due", "fresh"))],
)
def test_unknown_horizon(interval: float | None, expected_touch: tuple[str, ...]) -> None:
    sessions = [S("fresh", 965.0), S("due", 900.0), S("new", 990.0)]
    cfg = KeepaliveConfig(unknown_horizon_interval_s=interval)
    plan = plan_touches(sessions, math.inf, NOW, cfg)
    assert plan.touch == expected_touch
    assert plan.likely_lost == ()
    assert plan.next_due_at == (math.inf if interval is None else 1020.0)


def test_value_breaks_ties_then_id() -> None:
    sessions = [S("b", 900.0, value=1.0), S("a", 900.0, value=1.0), S("c", 900.0, value=3.0)]
    plan = plan_touches(sessions, 150.0, NOW, KeepaliveConfig(max_concurrent_touches=10))
    assert plan.touch == ("c", "a", "b")


@pytest.mark.parametrize(
    ("prompt_tokens", "block_size", "expected"),
    [
        (2017, 32, 1),
        (2016, 32, 32),
        (1, 32, 1),
        (33, 32, 1),
        (64, 32, 32),
        (0, 32, 0),
        (100, 16, 4),
    ],
)
def test_touch_cost_is_the_uncached_tail(
    prompt_tokens: int, block_size: int, expected: int
) -> None:
    assert touch_cost_tokens(prompt_tokens, block_size) == expected


def test_touch_cost_rejects_zero_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        touch_cost_tokens(10, 0)


@pytest.mark.parametrize(
    ("n", "horizon", "expected"),
    [(100, 100.0, 2.0), (0, 100.0, 0.0), (100, math.inf, 0.0), (10, 20.0, 1.0)],
)
def test_expected_touch_rate(n: int, horizon: float, expected: float) -> None:
    assert expected_touch_rate(n, horizon) == expected


def test_touch_interval() -> None:
    assert touch_interval(80.0, KeepaliveConfig(safety_fraction=0.25)) == 20.0
    assert touch_interval(math.inf, KeepaliveConfig()) == math.inf


@pytest.mark.parametrize(
    "kwargs", [{"safety_fraction": 0.0}, {"safety_fraction": 1.5}, {"max_concurrent_touches": 0}]
)
def test_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        KeepaliveConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n_blocks", "resident", "rate", "latency", "expected"),
    [
        (100, 100, 500.0, 0.1, 100),  # whole: sent whole, wherever the front is
        (100, 80, 500.0, 0.1, 30),  # the front is inside it: 50 more blocks go first
        (100, 80, 500.0, 0.2, 0),  # all of what is left goes before the touch runs
        (100, 80, 0.0, 0.1, 80),  # nothing is being allocated: all 80 are safe
        (100, 80, 10.0, 0.01, 79),  # a fraction of a block still costs the last one
        (100, 0, 0.0, 0.1, 0),  # nothing resident: nothing to touch
        (0, 0, 0.0, 0.1, 0),
    ],
)
def test_touch_extent_stops_short_of_what_the_front_takes_first(
    n_blocks: int, resident: int, rate: float, latency: float, expected: int
) -> None:
    assert touch_extent(n_blocks, resident, rate, latency) == expected
