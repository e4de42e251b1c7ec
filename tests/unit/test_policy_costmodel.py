"""Keep / offload / drop decisions and warm-up planning, with exact expected costs."""

from __future__ import annotations

import math

import pytest

from policy.costmodel import (
    CostParams,
    IdleSession,
    Retention,
    WarmCandidate,
    decide_retention,
    option_costs,
    plan_warmups,
    warm_gain_s,
    warm_work_s,
)
from policy.gaps import GapDistribution

P = CostParams()  # prefill 2.5 ms/token, load 0.25 ms/token, touch 50 ms, hold 0.1 ms/block-s
SLOW_RESUME = GapDistribution(math.log(600.0), 1.0, 0.9)  # median 10 min, 90% come back
TOOL_CALL = GapDistribution(math.log(5.0), 0.5, 0.95)  # median 5 s
NEVER = GapDistribution(math.log(5.0), 0.5, 0.0)


def idle(
    gap: GapDistribution, *, window: float, tier: bool, pressure: float, horizon: float = 60.0
) -> IdleSession:
    return IdleSession(
        n_tokens=10000 if gap is SLOW_RESUME else 2000,
        n_blocks=313 if gap is SLOW_RESUME else 63,
        gap=gap,
        elapsed_s=0.0,
        retention_s=window,
        horizon_s=horizon,
        has_offload_tier=tier,
        pressure=pressure,
    )


@pytest.mark.parametrize(
    ("session", "action"),
    [
        # "24h" retention under pressure: holding GPU blocks for hours loses to the tier
        (idle(SLOW_RESUME, window=86400.0, tier=True, pressure=1.0), Retention.OFFLOAD),
        # same without a tier: recompute on resume is cheaper than hours of residency
        (idle(SLOW_RESUME, window=86400.0, tier=False, pressure=1.0), Retention.DROP),
        # a tool call returning in seconds: a few touches are nearly free
        (idle(TOOL_CALL, window=300.0, tier=False, pressure=0.5), Retention.KEEP),
        (idle(TOOL_CALL, window=300.0, tier=True, pressure=0.5), Retention.KEEP),
        # a session that never returns: drop, even though keeping is cheap
        (idle(NEVER, window=300.0, tier=True, pressure=0.5), Retention.DROP),
        # no pressure and no evictions seen: keeping costs nothing
        (
            idle(SLOW_RESUME, window=300.0, tier=False, pressure=0.0, horizon=math.inf),
            Retention.KEEP,
        ),
    ],
)
def test_decide_retention(session: IdleSession, action: Retention) -> None:
    decision = decide_retention(session, P)
    assert decision.action is action
    chosen = {
        Retention.KEEP: decision.keep_cost_s,
        Retention.OFFLOAD: decision.offload_cost_s,
        Retention.DROP: decision.drop_cost_s,
    }[action]
    assert chosen == min(decision.keep_cost_s, decision.offload_cost_s, decision.drop_cost_s)
    assert decision.expected_savings_s == pytest.approx(decision.drop_cost_s - chosen)


def test_option_costs_exact_figures() -> None:
    s = idle(SLOW_RESUME, window=86400.0, tier=True, pressure=1.0)
    keep, offload, drop, p = option_costs(s, P)
    m = SLOW_RESUME.expected_wait_within(86400.0)
    assert m == pytest.approx(9530.3, abs=0.5)
    assert p == pytest.approx(0.9, abs=1e-6)
    assert keep == pytest.approx(m / 30.0 * 0.05 + 1e-4 * 313 * m)
    assert offload == pytest.approx(0.05 + p * 10000 * 2.5e-4)
    assert drop == pytest.approx(p * 10000 * 2.5e-3)
    no_tier = idle(SLOW_RESUME, window=86400.0, tier=False, pressure=1.0)
    assert option_costs(no_tier, P)[1] == math.inf


def test_never_returning_session_costs() -> None:
    decision = decide_retention(idle(NEVER, window=300.0, tier=True, pressure=0.5), P)
    # waits the whole window: 10 touches of 50 ms + 0.5 * 1e-4 * 63 blocks * 300 s
    assert decision.keep_cost_s == pytest.approx(0.5 + 0.945)
    assert decision.offload_cost_s == pytest.approx(0.05)
    assert (decision.drop_cost_s, decision.p_resume, decision.expected_savings_s) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("cand", "work"),
    [
        (WarmCandidate("a", 0.9, 1000), 2.5),
        (WarmCandidate("a", 0.9, 1000, offloaded_tokens=1000), 0.25),
        (WarmCandidate("a", 0.9, 1000, resident_tokens=200, offloaded_tokens=600), 1.1),
        (WarmCandidate("a", 0.9, 1000, resident_tokens=1000), 0.0),
        (WarmCandidate("a", 0.9, 1000, resident_tokens=600, offloaded_tokens=200), 1.0),
    ],
)
def test_warm_work(cand: WarmCandidate, work: float) -> None:
    assert warm_work_s(cand, P) == pytest.approx(work)


@pytest.mark.parametrize(
    ("p_next", "pressure", "gain"),
    [
        (0.9, 0.0, 2.5 * (0.9 - 0.1)),
        (0.5, 0.0, 0.0),  # break-even without pressure
        (0.6, 1.0, 2.5 * (0.6 - 0.4 * 2.0)),  # pressure doubles the waste: not worth it
        (0.3, 0.0, 2.5 * (0.3 - 0.7)),
    ],
)
def test_warm_gain(p_next: float, pressure: float, gain: float) -> None:
    assert warm_gain_s(WarmCandidate("a", p_next, 1000), P, pressure) == pytest.approx(gain)


def test_plan_warmups_best_first_positive_only() -> None:
    cands = [
        WarmCandidate("small", 0.9, 100),
        WarmCandidate("big", 0.8, 4000),
        WarmCandidate("unlikely", 0.2, 9000),
        WarmCandidate("resident", 0.99, 4000, resident_tokens=4000),
    ]
    assert plan_warmups(cands, P, max_warmups=5) == ("big", "small")
    assert plan_warmups(cands, P, max_warmups=1) == ("big",)
    assert plan_warmups(cands, P, pressure=1.0, max_warmups=5) == ("big", "small")
    assert plan_warmups(cands, P, max_warmups=0) == ()
    assert plan_warmups([], P) == ()
