"""Agent anchors: demand from the next-agent model, and which anchors to touch when."""

from __future__ import annotations

import math

import pytest

from policy.anchors import (
    AnchorConfig,
    AnchorView,
    anchor_demand,
    common_prefix,
    plan_anchor_touches,
)
from policy.predictor import TransitionConfig, TransitionModel


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_demand_sums_each_live_sessions_next_agent_distribution() -> None:
    model = TransitionModel(TransitionConfig(alpha=1e-9, decay=1.0))
    for _ in range(3):  # supervisor -> coder twice as often as -> writer
        model.observe("supervisor", "coder")
        model.observe("supervisor", "coder")
        model.observe("supervisor", "writer")
        model.observe("coder", "coder")  # a coder runs again (tool loop)
    demand = anchor_demand({"supervisor": 2, "coder": 1}, model)
    assert demand["coder"] == pytest.approx(2 * 2 / 3 + 1.0)
    assert demand["writer"] == pytest.approx(2 * 1 / 3)
    assert demand.get("supervisor", 0.0) == pytest.approx(0.0, abs=1e-6)
    assert anchor_demand({}, model) == {}


def a(
    anchor_id: str,
    *,
    n: int = 100,
    resident: int = 100,
    last: float = 0.0,
    demand: float = 1.0,
    allocated: int = 0,
    in_flight: bool = False,
    held: bool = False,
) -> AnchorView:
    return AnchorView(anchor_id, n, resident, last, demand, allocated, in_flight, held)


def plan(anchors: list[AnchorView], **kw: float) -> tuple[str, ...]:
    args = {"horizon_s": 10.0, "now": 100.0, "max_blocks": 1000.0, "urgent_blocks": 500.0}
    args.update(kw)
    return plan_anchor_touches(
        anchors,
        args["horizon_s"],
        args["now"],
        max_blocks=args["max_blocks"],
        urgent_blocks=args["urgent_blocks"],
        slots=int(kw.get("slots", 4)),
    )


def test_an_anchor_is_due_at_the_safety_share_of_the_horizon_oldest_first() -> None:
    anchors = [a("young", last=96.0), a("old", last=90.0), a("older", last=80.0)]
    assert plan(anchors) == ("older", "old")  # 4 s < 0.5 x 10 s: not yet
    assert plan(anchors, horizon_s=math.inf) == ()  # no eviction seen: nothing is lost
    # the allocation front moved past the urgent mark: due whatever the clock says
    assert plan([a("burst", last=99.0, allocated=600)], horizon_s=math.inf) == ("burst",)
    assert plan(anchors, slots=1) == ("older",)


def test_lost_idle_or_in_flight_anchors_are_never_touched() -> None:
    anchors = [
        a("lost", resident=0, last=0.0),  # a touch would re-prefill it all
        a("unwanted", demand=0.2, last=0.0),  # under min_demand 0.5
        a("busy", in_flight=True, last=0.0),
        a("kept", last=0.0),
    ]
    assert plan(anchors) == ("kept",)
    relaxed = AnchorConfig(min_demand=0.1)
    chosen = plan_anchor_touches(
        anchors, 10.0, 100.0, max_blocks=1e9, urgent_blocks=1e9, slots=4, config=relaxed
    )
    assert set(chosen) == {"unwanted", "kept"}


def test_the_pool_share_admits_anchors_by_demand_per_block() -> None:
    anchors = [
        a("big-popular", n=600, demand=3.0, last=0.0),  # 0.005 per block
        a("small-popular", n=100, demand=2.0, last=1.0),  # 0.02 per block
        a("mid", n=300, demand=3.0, last=2.0),  # 0.01 per block
    ]
    assert plan(anchors, max_blocks=450.0) == ("small-popular", "mid")
    assert plan(anchors, max_blocks=1000.0) == ("big-popular", "small-popular", "mid")
    assert plan(anchors, max_blocks=50.0) == ()


def test_only_anchors_kvkeeper_keeps_take_the_pool_share() -> None:
    # the dense anchor is used by its own traffic (1 s ago, not held): it costs nothing, so the
    # 300 blocks go to the due anchor; once the dense one is held by touches, it takes them
    dense = a("dense", n=300, demand=30.0, last=99.0)
    sparse = a("sparse", n=300, demand=1.0, last=0.0)
    assert plan([dense, sparse], max_blocks=300.0) == ("sparse",)
    held = a("dense", n=300, demand=30.0, last=99.0, held=True)
    assert plan([held, sparse], max_blocks=300.0) == ()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_demand"):
        AnchorConfig(min_demand=-1)
    with pytest.raises(ValueError, match="min_demand"):
        AnchorConfig(safety_fraction=0)
