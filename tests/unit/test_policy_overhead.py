"""The retention overhead budget (policy/overhead.py): a token bucket over served prompt tokens."""

from __future__ import annotations

import random

import pytest

from policy.overhead import OverheadBudget, OverheadConfig


def test_it_starts_full_and_earns_its_share_up_to_the_burst() -> None:
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=100))
    assert b.credit == 100
    assert b.admit(100) and b.credit == 0
    b.earn(5_000)  # 1% of 5,000
    assert b.credit == pytest.approx(50)
    b.earn(1_000_000)
    assert b.credit == 100  # capped: a quiet period banks no more than the burst


def test_what_the_credit_does_not_cover_is_declined_and_nothing_is_reserved() -> None:
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=100))
    assert not b.admit(101)
    assert b.credit == 100 and b.declined == 1
    assert b.admit(60) and not b.admit(60)  # the reservation counts: no double spending
    assert b.credit == pytest.approx(40) and b.declined == 2


def test_settling_returns_what_was_not_used_and_takes_what_was_overspent() -> None:
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=100))
    assert b.admit(50)
    b.settle(50, 10)  # it recomputed less than reserved: 40 come back
    assert b.credit == pytest.approx(90) and b.spent == 10
    assert b.admit(90)
    b.settle(90, 150)  # 60 more than reserved: the credit goes negative
    assert b.credit == pytest.approx(-60) and b.forgiven == 0
    assert not b.admit(0)  # an overdrawn bucket admits nothing, not even a free request
    b.earn(6_000)  # 60 tokens of credit pay the debt
    assert b.credit == pytest.approx(0) and b.admit(0) and not b.admit(1)


def test_one_accident_leaves_at_most_one_bucket_of_debt() -> None:
    """A touch that raced LRU recomputed ten buckets' worth: the debt stops at one bucket, the
    rest is counted as forgiven (the guard is charged with all of it), and the traffic that
    refills one bucket twice over brings touches back."""
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=4096))
    reserved = b.admit_touch()
    assert reserved == 1.0
    b.settle(reserved, 44_000, touch=True)
    assert b.credit == pytest.approx(-4096)
    assert b.forgiven == pytest.approx(44_000 - 4096 - 4096)  # less the full bucket and the cap
    assert b.spent == 44_000  # what it cost is still counted in full
    b.earn(409_600)  # one bucket: the debt is paid
    assert b.credit == pytest.approx(0) and b.admit_touch() is None
    b.earn(409_600)
    assert b.admit_touch() is not None


def test_one_outlier_cannot_price_touches_out_of_the_bucket_for_good() -> None:
    """Before: the 44K outlier put the estimate at 8.8K, more than a full bucket holds, so no
    touch was admitted again and none could bring the estimate back down. Now the estimate
    learns at most a bucket per touch, and cheap touches bring it back to one token."""
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=4096, touch_alpha=0.2))
    b.settle(b.admit_touch() or 0.0, 44_000, touch=True)
    assert b.touch_estimate <= 4096
    admitted = 0
    for _ in range(200):  # traffic goes on; each admitted touch costs one token
        b.earn(100_000)
        reserved = b.admit_touch()
        if reserved is not None:
            admitted += 1
            b.settle(reserved, 1, touch=True)
    assert admitted >= 190  # silenced for a few rounds of traffic, not for the rest of the run
    assert b.touch_estimate < 2.0
    assert b.admit_touch() is not None


def test_a_touch_is_never_priced_above_a_full_bucket() -> None:
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=500), touch_estimate=9_000)
    assert b.admit_touch() == 500.0  # an estimate above the bucket: a full bucket admits one
    assert b.admit_touch() is None
    empty = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=0))
    assert empty.admit_touch() is None  # a bucket of nothing admits nothing


def test_touch_costs_are_learned_from_what_touches_recomputed() -> None:
    b = OverheadBudget(OverheadConfig(share=0.5, burst_tokens=10_000, touch_alpha=0.5))
    assert b.admit_touch() == 1.0  # a resident prefix costs one token
    b.settle(1.0, 1_001, touch=True)
    assert b.touch_estimate == pytest.approx(501)
    assert b.admit_touch() == 501.0
    b.settle(501.0, 1, touch=True)
    assert b.touch_estimate == pytest.approx(251)
    b.settle(0.0, 0, touch=True)  # never below one token
    b.settle(0.0, 0, touch=True)
    assert b.touch_estimate >= 1.0


def test_each_kind_of_touch_has_its_own_estimate() -> None:
    """Costly session touches do not price a cheap kind of touch (one token each) out of the budget."""
    b = OverheadBudget(OverheadConfig(share=0.5, burst_tokens=2_000, touch_alpha=0.5))
    b.settle(1.0, 1_001, touch=True)  # a session touch that lost its tail
    assert b.admit_touch() == 501.0
    assert b.admit_touch("cheap") == 1.0  # none of that kind seen yet: a resident prefix
    b.settle(1.0, 1, touch=True, kind="cheap")
    assert b.estimate("cheap") == 1.0 and b.touch_estimate == pytest.approx(501)
    assert b.admit_touch() is None  # 498 credit left: not another session touch...
    assert b.admit_touch("cheap") == 1.0  # ...but a cheap touch still fits


def test_unbounded_admits_everything_and_still_counts() -> None:
    b = OverheadBudget(OverheadConfig(share=None))
    assert not b.bounded
    assert b.admit(10**9) and b.admit_touch() is not None
    b.settle(0, 10**9)
    assert b.spent == 10**9 and b.declined == 0


def test_over_a_long_run_the_recompute_stays_within_share_plus_burst() -> None:
    """Random traffic and random touch/warm-up costs, settled late (several in flight): what
    was recomputed never exceeds share x served + burst, plus what admitted requests overshot
    their estimates and traffic has not yet paid back (the debt, or still in flight), plus
    what the debt cap forgave."""
    rng = random.Random(7)
    share, burst = 0.015, 8192.0
    b = OverheadBudget(OverheadConfig(share=share, burst_tokens=burst))
    served = 0
    in_flight: list[tuple[float, float, bool]] = []
    for _ in range(20_000):
        tokens = rng.randint(0, 20_000)
        served += tokens
        b.earn(tokens)
        if rng.random() < 0.3:
            reserved = b.admit_touch()
            if reserved is not None:
                in_flight.append((reserved, rng.expovariate(1 / 400), True))
        if rng.random() < 0.05:
            cost = rng.randint(1, 30_000)
            if b.admit(cost):
                in_flight.append((cost, cost * rng.uniform(0.5, 1.2), False))
        while len(in_flight) > 4:
            reserved, actual, touch = in_flight.pop(0)
            b.settle(reserved, actual, touch=touch)
        overshoot = sum(max(0.0, a - r) for r, a, _ in in_flight)
        debt = max(0.0, -b.credit)
        assert b.spent <= share * served + burst + debt + overshoot + b.forgiven + 1e-6
        assert debt <= burst  # at most one bucket, whatever the requests in flight overshot
    assert b.spent > 0.5 * share * served  # and it does spend


@pytest.mark.parametrize(
    "kwargs", [{"share": 0.0}, {"share": 1.5}, {"burst_tokens": -1}, {"touch_alpha": 0.0}]
)
def test_bad_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        OverheadConfig(**kwargs)  # type: ignore[arg-type]
