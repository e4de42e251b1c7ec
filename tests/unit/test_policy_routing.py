"""Engine choice: filters, scorers in [0, 1], deterministic pick, failover order."""

from __future__ import annotations

import pytest

from policy.routing import (
    EngineCandidate,
    PrefixCandidate,
    PrefixPlacementConfig,
    RouteRequest,
    RoutingConfig,
    is_overloaded,
    load_score,
    place_by_prefix,
    route,
    score_engine,
)

E = EngineCandidate


@pytest.mark.parametrize(
    ("candidates", "req", "engine", "failover", "reason"),
    [
        # affinity 3*1 + load 0.5 = 3.5/8 beats prefix 2*1 + load 1 = 3/8
        (
            [E("e1", kv_cache_usage=0.5), E("e2", resident_prefix_blocks=10)],
            RouteRequest(prompt_blocks=10, affinity="e1"),
            "e1",
            ("e2",),
            "affinity",
        ),
        # the affinity engine is overloaded: filtered first, kept as a late failover
        (
            [E("e1", kv_cache_usage=0.97), E("e2", resident_prefix_blocks=10)],
            RouteRequest(prompt_blocks=10, affinity="e1"),
            "e2",
            ("e1",),
            "prefix",
        ),
        # every engine overloaded: still answer, best of them
        (
            [E("e1", waiting=20.0, running=1.0), E("e2", waiting=40.0, running=1.0)],
            RouteRequest(),
            "e1",
            ("e2",),
            "load",
        ),
        # a child with no affinity goes to its parent's engine
        (
            [E("e1"), E("e2", kv_cache_usage=0.3)],
            RouteRequest(prompt_blocks=4, parent_engine="e2"),
            "e2",
            ("e1",),
            "parent",
        ),
        # longest resident prefix wins at equal load
        (
            [E("e4", resident_prefix_blocks=2), E("e3", resident_prefix_blocks=8)],
            RouteRequest(prompt_blocks=10),
            "e3",
            ("e4",),
            "prefix",
        ),
        # identical candidates: name order
        ([E("b"), E("a")], RouteRequest(), "a", ("b",), "load"),
        # unhealthy engines never appear
        (
            [E("dead", healthy=False, resident_prefix_blocks=10), E("ok")],
            RouteRequest(prompt_blocks=10, affinity="dead"),
            "ok",
            (),
            "load",
        ),
        ([E("dead", healthy=False)], RouteRequest(), None, (), "no_healthy_engine"),
        ([], RouteRequest(), None, (), "no_healthy_engine"),
    ],
)
def test_route(
    candidates: list[EngineCandidate],
    req: RouteRequest,
    engine: str | None,
    failover: tuple[str, ...],
    reason: str,
) -> None:
    decision = route(candidates, req)
    assert decision.engine == engine
    assert decision.failover == failover
    assert decision.reason == reason


def test_scores_are_exact_and_within_unit_interval() -> None:
    cfg = RoutingConfig()
    c = E("e1", kv_cache_usage=0.5, resident_prefix_blocks=5)
    s = score_engine(c, RouteRequest(prompt_blocks=10, affinity="e1", parent_engine="e1"), 5, cfg)
    assert (s.affinity, s.parent, s.prefix, s.load) == (1.0, 1.0, 0.5, 0.5)
    assert s.total == pytest.approx((3 + 2 + 1 + 0.5) / 8)
    for cand in [
        E("x", kv_cache_usage=1.5, waiting=-1.0, resident_prefix_blocks=99),
        E("y", kv_cache_usage=-0.2, running=-5.0, resident_prefix_blocks=-3),
    ]:
        sc = score_engine(cand, RouteRequest(prompt_blocks=10), 99, cfg)
        for v in (sc.affinity, sc.parent, sc.prefix, sc.load, sc.total):
            assert 0.0 <= v <= 1.0


@pytest.mark.parametrize(
    ("cand", "expected"),
    [
        (E("a", kv_cache_usage=0.5, running=3.0), 0.5),
        (E("a", waiting=4.0, running=3.0), 0.5),
        (E("a", kv_cache_usage=1.2), 0.0),
        (E("a"), 1.0),
    ],
)
def test_load_score(cand: EngineCandidate, expected: float) -> None:
    assert load_score(cand) == expected


@pytest.mark.parametrize(
    ("cand", "overloaded"),
    [
        (E("a", kv_cache_usage=0.95), False),
        (E("a", kv_cache_usage=0.96), True),
        (E("a", waiting=16.0), False),
        (E("a", waiting=17.0), True),
    ],
)
def test_overload_filter(cand: EngineCandidate, overloaded: bool) -> None:
    assert is_overloaded(cand, RoutingConfig()) is overloaded


def test_zero_weights_and_config_validation() -> None:
    cfg = RoutingConfig(affinity_weight=0, parent_weight=0, prefix_weight=0, load_weight=0)
    decision = route([E("b"), E("a")], RouteRequest(affinity="b"), cfg)
    assert decision.engine == "a"  # every total is 0: name order decides
    with pytest.raises(ValueError, match="weights"):
        RoutingConfig(load_weight=-1.0)


def test_ranking_lists_every_healthy_engine_once() -> None:
    cands = [E(f"e{i}", kv_cache_usage=i / 20, resident_prefix_blocks=i) for i in range(20)]
    decision = route(cands, RouteRequest(prompt_blocks=19))
    assert decision.engine is not None
    assert sorted((decision.engine, *decision.failover)) == sorted(c.name for c in cands)
    assert [s.name for s in decision.scores] == [decision.engine, *decision.failover]


# --- placement by the request's own prompt ---------------------------------------------------
P = PrefixCandidate


@pytest.mark.parametrize(
    ("candidates", "engine", "failover", "reason"),
    [
        # idle replicas: the longest match, however much the replica holds
        ([P("a", matched=3, cached=900), P("b", cached=10)], "a", ("b",), "prefix"),
        ([P("a", matched=4), P("b", matched=6)], "b", ("a",), "prefix"),
        # a match is worth its tokens of queue: 6 chunks x 100 tokens = 600
        ([P("a", matched=6, pending=500), P("b")], "a", ("b",), "prefix"),
        ([P("a", matched=6, pending=700), P("b")], "b", ("a",), "load"),
        # equal cost: the longer match
        ([P("a", matched=6, pending=600), P("b")], "a", ("b",), "prefix"),
        # nobody has it: the shorter queue, then the replica asked to hold less, then the
        # order given (the runtime rotates it: round robin on full ties)
        ([P("a", pending=50, cached=1), P("b", pending=10, cached=99)], "b", ("a",), "spread"),
        ([P("a", cached=50), P("b", cached=40)], "b", ("a",), "spread"),
        ([P("b", cached=5), P("a", cached=5)], "b", ("a",), "spread"),
        ([P("a", cached=5), P("b", cached=5)], "a", ("b",), "spread"),
        # unhealthy replicas are never returned
        ([P("a", healthy=False, matched=10), P("b")], "b", (), "spread"),
        ([P("a", healthy=False)], None, (), "no_healthy_engine"),
    ],
)
def test_place_by_prefix(
    candidates: list[PrefixCandidate], engine: str | None, failover: tuple[str, ...], reason: str
) -> None:
    decision = place_by_prefix(candidates, 10, 100.0)
    assert (decision.engine, decision.failover, decision.reason) == (engine, failover, reason)


def test_place_by_prefix_miss_weight_values_the_cache_above_the_queue() -> None:
    busy_holder = [P("a", matched=6, pending=900), P("b")]
    assert place_by_prefix(busy_holder, 10, 100.0).engine == "b"  # 900 > 600
    heavier = PrefixPlacementConfig(miss_weight=2.0)  # the 600 tokens now weigh 1200
    assert place_by_prefix(busy_holder, 10, 100.0, heavier).engine == "a"
    with pytest.raises(ValueError, match="miss_weight"):
        PrefixPlacementConfig(miss_weight=0)
