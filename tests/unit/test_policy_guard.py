"""The retention guard (policy/guard.py): retention's cost against the hits it bought, per engine."""

from __future__ import annotations

import math

import pytest

from policy.guard import ACTIVE, BACKED_OFF, GuardConfig, RetentionGuard, lru_would_have_kept


def test_without_evidence_it_allows_everything() -> None:
    g = RetentionGuard(GuardConfig(min_evidence_tokens=1000))
    g.spend(900, waiting=0, now=0.0)  # below the evidence threshold, nothing bought
    assert g.allows(0.0) and g.state(0.0) == ACTIVE
    assert g.balance(0.0) == pytest.approx(-900)


def test_queueing_weighs_a_recompute_by_the_requests_it_delays() -> None:
    g = RetentionGuard(GuardConfig(queue_weight=0.5))
    assert g.spend(100, waiting=0, now=0.0) == 100
    assert g.spend(100, waiting=4, now=0.0) == pytest.approx(300)  # 1 + 0.5 x 4
    assert g.loaded(1000, now=0.0) == pytest.approx(100)  # a tier load: a tenth of a re-prefill
    assert g.buy(500, now=0.0, baseline=200) == 300  # what the resume would have hit anyway
    assert g.balance(0.0) == pytest.approx(300 - 500)


def test_it_backs_off_when_the_measured_balance_turns_negative() -> None:
    g = RetentionGuard(GuardConfig(min_evidence_tokens=1000, cooldown_s=30, half_life_s=60))
    # retention paying for itself: touches that cost 1 token each kept 2,000-token prefixes
    for t in range(10):
        g.spend(1, waiting=2, now=float(t))
        g.buy(2000, now=float(t) + 0.5)
    g.spend(2000, waiting=0, now=10.0)
    assert g.allows(10.0) and g.balance(10.0) > 0
    # then its touches re-prefill evicted prefixes in a queue and the resumes miss anyway
    for t in range(11, 20):
        g.spend(3000, waiting=3, now=float(t))
    assert g.balance(20.0) < 0
    assert not g.allows(20.0)
    assert g.state(20.0) == BACKED_OFF and g.backoffs == 1
    assert not g.allows(49.0)  # the cooldown holds
    view = g.view(25.0)
    assert view["state"] == BACKED_OFF and view["balance_tokens"] < 0
    assert view["backed_off_for_s"] == pytest.approx(25.0)


def test_after_a_cooldown_it_measures_afresh_and_a_probe_that_fails_doubles_the_next() -> None:
    g = RetentionGuard(GuardConfig(min_evidence_tokens=100, cooldown_s=10, max_cooldown_s=25))
    g.spend(500, waiting=0, now=0.0)
    assert not g.allows(0.0) and g.until == 10.0
    assert g.allows(10.0) and g.balance(10.0) == 0  # the old account is gone
    g.spend(500, waiting=0, now=11.0)
    assert not g.allows(11.0) and g.until == pytest.approx(31.0)  # 20 s: doubled
    assert g.allows(31.0)
    g.spend(500, waiting=0, now=32.0)
    assert not g.allows(32.0) and g.until == pytest.approx(57.0)  # capped at 25 s
    # a probe that pays resets the cooldown
    assert g.allows(57.0)
    g.spend(500, waiting=0, now=58.0)
    g.buy(5000, now=58.0)
    assert g.allows(58.0) and g.cooldown_s == 10
    assert g.backoffs == 3


def test_old_cost_decays_so_a_past_mistake_does_not_block_retention_forever() -> None:
    g = RetentionGuard(GuardConfig(min_evidence_tokens=100, half_life_s=10))
    g.spend(1000, waiting=0, now=0.0)
    g.buy(900, now=0.0)
    assert g.balance(0.0) == pytest.approx(-100)
    assert g.balance(10.0) == pytest.approx(-50)  # both halve
    g.buy(200, now=10.0)
    assert g.allows(10.0) and g.balance(10.0) == pytest.approx(150)
    assert g.total_cost == 1000 and g.total_bought == 1100  # the counters never decay


def test_a_disabled_guard_always_allows() -> None:
    g = RetentionGuard(GuardConfig(enabled=False, min_evidence_tokens=0))
    g.spend(10_000, waiting=10, now=0.0)
    assert g.allows(0.0) and g.backoffs == 0


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        GuardConfig(half_life_s=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        GuardConfig(cooldown_s=100, max_cooldown_s=10)
    with pytest.raises(ValueError, match="queue_weight"):
        GuardConfig(queue_weight=-1)


def test_a_resume_within_the_lru_horizon_credits_nothing() -> None:
    """Plain LRU keeps an unused prefix for the horizon: a session back before it ends would
    have hit without retention, so what retention kept for it bought nothing."""
    g = RetentionGuard()
    assert g.resume(2000, now=0.0, pause_s=20.0, horizon_s=60.0) == 0
    assert g.resume(2000, now=1.0, pause_s=500.0, horizon_s=math.inf) == 0  # nothing evicted yet
    assert g.bought == 0 and g.total_bought == 0 and g.balance(1.0) == 0
    view = g.view(1.0)
    assert view["resumes_within_horizon"] == 2 and view["resumes_credited"] == 0
    assert view["total_within_horizon_tokens"] == 4000 and view["bought_tokens"] == 0


def test_a_resume_beyond_the_lru_horizon_credits_the_kept_tokens() -> None:
    g = RetentionGuard()
    assert g.resume(2000, now=0.0, pause_s=90.0, horizon_s=60.0) == 2000
    assert g.resume(2000, now=0.0, pause_s=90.0, horizon_s=60.0, baseline=500) == 1500
    assert g.resume(0, now=0.0, pause_s=90.0, horizon_s=60.0) == 0  # nothing hit
    assert g.balance(0.0) == pytest.approx(3500)
    view = g.view(0.0)
    assert view["resumes_credited"] == 2 and view["resumes_within_horizon"] == 0
    assert view["within_horizon_tokens"] == 0 and view["total_bought_tokens"] == 3500


def test_retention_that_only_keeps_what_lru_kept_anyway_is_backed_off() -> None:
    """Touches cost recompute while every resume comes back within the horizon: the hits do
    not count, the balance is the cost alone and the guard backs off."""
    g = RetentionGuard(GuardConfig(min_evidence_tokens=1000, cooldown_s=30))
    for t in range(10):
        g.spend(200, waiting=1, now=float(t))
        g.resume(20_000, now=float(t) + 0.5, pause_s=5.0, horizon_s=120.0)
    assert g.balance(10.0) < 0 and g.within_horizon > 100_000
    assert not g.allows(10.0) and g.state(10.0) == BACKED_OFF


def test_lru_would_have_kept_a_prefix_only_within_its_horizon() -> None:
    assert lru_would_have_kept(10.0, 60.0) and lru_would_have_kept(1e9, math.inf)
    assert not lru_would_have_kept(60.0, 60.0) and not lru_would_have_kept(61.0, 60.0)
