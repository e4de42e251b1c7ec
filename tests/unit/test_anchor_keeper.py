"""The anchor keeper's request-path side: transitions, samples, demand window, tenants."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.anchors import Anchor, AnchorKeeper
from proxy.metrics import Metrics

E = "engine-a"


def keeper(**kw: Any) -> AnchorKeeper:
    touches: Any = None  # the request path never touches
    return AnchorKeeper(Metrics(), touches, safety_fraction=0.5, max_touches=4, **kw)


def call(k: AnchorKeeper, sid: str, agent: str, at: float, tenant: str = "t") -> None:
    k.observe(E, tenant, sid, agent, "/v1/completions", f"{sid}:{agent}".encode(), at)


def test_each_sessions_calls_teach_the_next_agent_model() -> None:
    k = keeper()
    for i in range(4):
        call(k, f"s{i}", "supervisor", 1.0)
        call(k, f"s{i}", "coder", 2.0)
    assert k.models["t"].probability("supervisor", "coder") > 0.8
    assert k.models["t"].probability(None, "supervisor") == pytest.approx(0.5, abs=0.05)
    demand = k.demand(now=3.0)  # four sessions whose last agent is the coder
    assert sum(demand.values()) == pytest.approx(4.0)
    k.forget("t", "s0")
    assert sum(k.demand(now=3.0).values()) == pytest.approx(3.0)
    assert k.demand(now=3.0 + 31.0) == {}  # idle past the window (30 s): not live


def test_an_anchor_is_sampled_from_two_sessions_of_one_tenant() -> None:
    k = keeper()
    call(k, "s1", "coder", 1.0)
    call(k, "s1", "coder", 2.0)  # the same session again: replaces the first sample
    anchor = k.anchors[E][("t", "coder")]
    assert anchor.first is not None and anchor.first.body == b"s1:coder" and not anchor.learnable
    call(k, "s9", "coder", 3.0, tenant="other")  # another tenant: its own anchor
    assert not anchor.learnable and ("other", "coder") in k.anchors[E]
    call(k, "s2", "coder", 4.0)
    assert anchor.learnable and anchor.second is not None and anchor.second.session_id == "s2"
    assert anchor.last_used == 4.0


def test_a_learned_anchor_is_sampled_again_only_after_the_relearn_count() -> None:
    k = keeper(relearn_calls=3)
    anchor = k.anchors.setdefault(E, {}).setdefault(("t", "coder"), Anchor("coder"))
    anchor.blocks, anchor.learn_after = (1, 2, 3), 3
    call(k, "s1", "coder", 1.0)
    call(k, "s2", "coder", 2.0)
    assert anchor.first is None  # two calls since learning: not yet
    call(k, "s3", "coder", 3.0)
    assert anchor.first is not None and anchor.first.session_id == "s3"


def test_the_engine_view_shows_a_tenant_only_its_own_anchors() -> None:
    k = keeper()
    for tenant in ("t", "other"):
        call(k, "s1", "coder", 1.0, tenant=tenant)
        k.anchors[E][(tenant, "coder")].blocks = (1, 2, 3, 4)
    assert {a["tenant"] for a in k.view(E, 2.0)} == {"t", "other"}
    mine = k.view(E, 2.0, tenant="t")
    assert [(a["tenant"], a["agent"], a["blocks"]) for a in mine] == [("t", "coder", 4)]
    assert mine[0]["demand"] == pytest.approx(1.0) and mine[0]["idle_s"] == 1.0


def test_anchors_per_engine_are_bounded_least_recently_used_dropped() -> None:
    k = keeper()
    for i in range(1025):  # agent names come from clients
        call(k, "s", f"agent-{i}", float(i))
    assert len(k.anchors[E]) == 1024
    assert ("t", "agent-0") not in k.anchors[E] and ("t", "agent-1024") in k.anchors[E]
