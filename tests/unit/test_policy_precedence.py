"""Sessions the client protected take precedence over guessed ones (``policy.returns``) wherever
retention rations: the soft-TTL budget, touch slots, tier pins, and the overhead credit."""

from __future__ import annotations

from policy import (
    BudgetSession,
    KeepaliveConfig,
    PinCandidate,
    ProtectedSession,
    allocate_budget,
    plan_pins,
    plan_touches,
)
from policy.overhead import OverheadBudget, OverheadConfig


def test_the_budget_keeps_a_client_protection_before_a_more_valuable_guess() -> None:
    guess = BudgetSession("guess", (1, 2, 3), value=100.0, guessed=True)
    client = BudgetSession("client", (4, 5, 6), value=1.0)
    small_guess = BudgetSession("small", (7,), value=50.0, guessed=True)
    decision = allocate_budget([guess, client, small_guess], 4)
    assert decision.keep == ("client", "small")  # a guess takes only what the client left
    assert decision.pressure_override == ("guess",)
    # among guesses (and among clients) the value order still holds
    both = allocate_budget([guess, small_guess], 3)
    assert both.keep == ("guess",) and both.pressure_override == ("small",)


def test_touch_slots_go_to_client_sessions_first() -> None:
    cfg = KeepaliveConfig(safety_fraction=0.5, max_concurrent_touches=2)
    sessions = [
        ProtectedSession("guess-oldest", 0.0, 1000.0, 8, guessed=True),
        ProtectedSession("client-lost", 10.0, 1000.0, 8),  # past the horizon
        ProtectedSession("client", 50.0, 1000.0, 8),
        ProtectedSession("guess", 40.0, 1000.0, 8, guessed=True),
    ]
    plan = plan_touches(sessions, horizon_s=80.0, now=100.0, config=cfg)
    assert plan.touch == ("client", "client-lost")
    assert plan.deferred == ("guess", "guess-oldest")  # then in the usual order among guesses


def test_tier_pins_go_to_client_sessions_first() -> None:
    candidates = [
        PinCandidate("guess-soon", 4, next_use_s=5, pinned=True, guessed=True),
        PinCandidate("client-late", 4, next_use_s=300),
        PinCandidate("guess-small", 2, next_use_s=10, guessed=True),
    ]
    assert plan_pins(candidates, capacity_chunks=6, share=1.0) == ["client-late", "guess-small"]


def test_a_guessed_touch_spends_only_the_credit_client_sessions_leave() -> None:
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=100), touch_estimate=10.0)
    reserve = b.guessed_reserve(5)  # five client-protected sessions, one touch each
    assert reserve == 50.0
    assert b.admit_touch() == 10.0  # a client's touch needs no reserve: credit 90
    assert b.admit_touch(reserve=reserve) == 10.0  # 80 left >= 50
    b.credit = 55.0
    assert b.admit_touch(reserve=reserve) is None  # 45 would be left: declined, nothing taken
    assert b.credit == 55.0 and b.declined == 1
    assert b.admit_touch() == 10.0  # the client's touch still goes through
    assert b.guessed_reserve(0) == 0.0
    assert b.admit_touch(reserve=0.0) == 10.0  # no client sessions: a guess spends freely


def test_a_full_bucket_still_admits_a_guess_and_an_unbounded_one_ignores_the_reserve() -> None:
    b = OverheadBudget(OverheadConfig(share=0.01, burst_tokens=100), touch_estimate=10.0)
    assert b.admit_touch(reserve=1_000.0) == 10.0  # full: the credit would earn nothing more
    assert b.admit_touch(reserve=1_000.0) is None
    free = OverheadBudget(OverheadConfig(share=None), touch_estimate=10.0)
    free.credit = 0.0
    assert free.admit_touch(reserve=1_000.0) == 10.0
