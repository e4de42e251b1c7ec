"""Soft-TTL budget: the shrink rule, shared-block accounting, which protections lapse."""

from __future__ import annotations

import math

import pytest

from policy.budget import (
    BudgetConfig,
    BudgetSession,
    EngineLoad,
    allocate_budget,
    effective_budget,
    load_pressure,
    plan_budget,
    session_value,
)

CFG = BudgetConfig(share=0.5, usage_high=0.85, min_factor=0.1)


@pytest.mark.parametrize(
    ("load", "budget", "pressure"),
    [
        (EngineLoad(1000), 500, 0.0),
        (EngineLoad(1000, kv_cache_usage=0.5, waiting=0.0, running=4.0), 500, 0.0),
        (EngineLoad(1000, kv_cache_usage=0.85), 500, 0.0),
        (EngineLoad(1000, kv_cache_usage=1.0), 50, 1.0),
        (EngineLoad(1000, waiting=2.0, running=4.0), 275, 0.5),
        (EngineLoad(1000, waiting=8.0, running=4.0), 50, 1.0),
        (EngineLoad(1000, waiting=3.0, running=0.0), 50, 1.0),  # queue with nothing running
        (EngineLoad(0), 0, 0.0),
    ],
)
def test_effective_budget(load: EngineLoad, budget: int, pressure: float) -> None:
    assert effective_budget(load, CFG) == (budget, pressure)


def test_usage_between_high_and_full_shrinks_linearly() -> None:
    load = EngineLoad(1000, kv_cache_usage=0.925)
    assert load_pressure(load, CFG) == pytest.approx(0.5)
    budget, _ = effective_budget(load, CFG)
    assert budget == 275  # 500 * (0.5 + 0.5 * 0.1)


def test_worse_of_usage_and_waiting_wins() -> None:
    load = EngineLoad(1000, kv_cache_usage=0.925, waiting=4.0, running=4.0)
    assert load_pressure(load, CFG) == 1.0


A = BudgetSession("A", (1, 2, 3, 4), value=10.0)
B = BudgetSession("B", (1, 2, 3, 4, 5, 6), value=8.0)  # shares 4 blocks with A
C = BudgetSession("C", (7, 8, 9), value=5.0)
D = BudgetSession("D", (10,), value=1.0)


@pytest.mark.parametrize(
    ("budget", "keep", "override", "blocks"),
    [
        (100, ("A", "B", "C", "D"), (), 10),  # 17 listed ids, 10 distinct
        (7, ("A", "B", "D"), ("C",), 7),  # B costs 2 after A; C does not fit, D does
        (3, ("C",), ("D", "B", "A"), 3),  # least valuable first in the override list
        (0, (), ("D", "C", "B", "A"), 0),
    ],
)
def test_allocate_budget(
    budget: int, keep: tuple[str, ...], override: tuple[str, ...], blocks: int
) -> None:
    decision = allocate_budget([D, C, B, A], budget)
    assert decision.keep == keep
    assert decision.pressure_override == override
    assert decision.protected_blocks == blocks
    assert decision.budget_blocks == budget


def test_equal_value_prefers_fewer_blocks_then_id() -> None:
    big = BudgetSession("big", (1, 2, 3), 1.0)
    small_b = BudgetSession("b", (4,), 1.0)
    small_a = BudgetSession("a", (5,), 1.0)
    decision = allocate_budget([big, small_b, small_a], 2)
    assert decision.keep == ("a", "b")
    assert decision.pressure_override == ("big",)


def test_plan_budget_under_pressure() -> None:
    load = EngineLoad(20, waiting=8.0, running=4.0)  # full pressure: 20 * 0.5 * 0.1 = 1 block
    decision = plan_budget([A, C, D], load, CFG)
    assert decision.budget_blocks == 1
    assert decision.pressure == 1.0
    assert decision.keep == ("D",)
    assert decision.pressure_override == ("C", "A")


@pytest.mark.parametrize(
    ("n_blocks", "p", "wait", "expected"),
    [
        (10, 0.5, 5.0, 1.0),
        (10, 0.5, 0.1, 5.0),
        (10, 1.5, 10.0, 1.0),
        (-3, 0.5, 1.0, 0.0),
        (10, 0.0, 1.0, 0.0),
    ],
)
def test_session_value(n_blocks: int, p: float, wait: float, expected: float) -> None:
    assert session_value(n_blocks, p, wait) == expected


def test_config_rejects_bad_values() -> None:
    for kwargs in ({"share": 1.5}, {"min_factor": -0.1}, {"usage_high": 1.0}):
        with pytest.raises(ValueError):  # noqa: PT011
            BudgetConfig(**kwargs)
    assert math.isclose(BudgetConfig().share, 0.5)
