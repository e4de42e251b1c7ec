"""The benchmark target registry: every entry is consistent with what runs it."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.bench_targets import TARGETS, BenchTarget, plan_targets, split_target, target_of
from loadgen.sim.server import SimConfig
from proxy.settings import RETENTION_KEYS


@pytest.mark.parametrize(("name", "target"), TARGETS.items())
def test_every_target_names_real_settings(name: str, target: BenchTarget) -> None:
    assert set(target.retention) <= RETENTION_KEYS, name
    assert set(target.sim) <= {f.name for f in dataclasses.fields(SimConfig)}, name
    dataclasses.replace(SimConfig(), **target.sim)  # the overrides are valid SimConfig values
    if target.kind != "kvkeeper":
        assert not target.retention and target.hints == "none", name
    assert (target.router_policy is not None) == (target.kind == "router"), name
    assert target.evict_rule is None or target.kind == "engine", name


def test_defaults_depend_on_replicas() -> None:
    one = [n for n, _ in plan_targets((), 1, "/r")]
    two = [n for n, _ in plan_targets((), 2, "/r")]
    assert "engine" in one and "engine" not in two
    assert "vllm-router" in two and "vllm-router" not in one
    assert all(TARGETS[n].default for n in one + two)


def test_settings_after_at_are_parsed() -> None:
    assert split_target("full+pins@tier_pin_share=0.8@tick_s=1") == (
        "full+pins",
        {"tier_pin_share": 0.8, "tick_s": 1},
    )
    assert target_of("full+pins@tier_pin_share=0.8") is TARGETS["full+pins"]


def test_floor_runs_on_one_replica_only() -> None:
    assert plan_targets(("engine", "floor", "none"), 1, None) == [
        ("engine", None),
        ("floor", None),
        ("none", None),
    ]
    assert plan_targets(("floor",), 2, None) == [
        ("floor", "several replicas: a plain client cannot spread over them")
    ]
    with pytest.raises(ValueError, match="only kvkeeper targets"):
        plan_targets(("floor@tick_s=1",), 1, None)
