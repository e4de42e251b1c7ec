"""Agent anchors: the prompt prefix every call of one agent starts with, and which to keep warm.

An agent's anchor (its system prompt and tool definitions) starts every call of that agent, from
every session, so it is worth more than any one session's context; yet between that agent's
calls no session is paused on it, and LRU takes it like anything else. CacheScout's answer:
keep the anchors of the agents likely to run next. The expected number of calls an agent gets
next is its *demand*::

    demand(Y) = sum over live sessions s of P(next agent = Y | last agent of s)

with ``P`` from the online Markov model (:mod:`policy.predictor`).

Rules of :func:`plan_anchor_touches`, in order:

1. an anchor with a touch in flight, nothing resident, or a demand under ``min_demand`` is
   never touched (touching a lost anchor would be a full re-prefill nobody asked for);
2. an anchor is due when its age (since its agent's last call or its last touch) has reached
   ``safety_fraction`` x the LRU horizon, or when the engine has allocated at least
   ``urgent_blocks`` blocks since then (a burst moves the LRU front faster than any rate);
3. the anchors that hold the pool because of kvkeeper (due now, or last kept alive by a touch
   rather than by their agent's calls) are admitted by demand per block, highest first (then
   id), while their blocks fit in ``max_blocks`` (the share of the pool anchors may hold); an
   anchor its own traffic keeps recent costs nothing and takes none of that share;
4. admitted due anchors are touched oldest first (then id), at most ``slots`` of them.

Pure: ``now`` is an argument, nothing does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from policy.predictor import TransitionModel

K = TypeVar("K", str, tuple[str, str])  # an anchor's key: a name, or (tenant, agent)


@dataclass(frozen=True, slots=True)
class AnchorView(Generic[K]):
    """One anchor on one engine this tick: ``n_blocks`` learned blocks, ``resident_blocks`` of
    them still cached (leading), ``last_used_at`` its agent's last call or its last touch,
    ``allocated_since`` blocks the engine allocated since then; ``held``: that last use was a
    touch (kvkeeper, not its traffic, keeps it)."""

    anchor_id: K
    n_blocks: int
    resident_blocks: int
    last_used_at: float
    demand: float
    allocated_since: int = 0
    touch_in_flight: bool = False
    held: bool = False


@dataclass(frozen=True, slots=True)
class AnchorConfig:
    """``min_demand``: expected next calls below which an anchor is left to LRU;
    ``safety_fraction``: touch once an anchor has used this share of the horizon."""

    min_demand: float = 0.5
    safety_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.min_demand < 0 or not 0.0 < self.safety_fraction <= 1.0:
            raise ValueError("need min_demand >= 0 and safety_fraction within (0, 1]")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def anchor_demand(last_agents: Mapping[str, int], model: TransitionModel) -> dict[str, float]:
    """Expected next calls per agent: ``last_agents`` counts the live sessions by their last
    agent; each contributes that agent's row of next-agent probabilities."""
    demand: dict[str, float] = {}
    for prev, sessions in last_agents.items():
        for agent, p in model.predict(prev):
            demand[agent] = demand.get(agent, 0.0) + sessions * p
    return demand


def plan_anchor_touches(
    anchors: Sequence[AnchorView[K]],
    horizon_s: float,
    now: float,
    *,
    max_blocks: float,
    urgent_blocks: float,
    slots: int,
    config: AnchorConfig | None = None,
) -> tuple[K, ...]:
    """The anchors to touch now (module rules), oldest first."""
    cfg = config or AnchorConfig()
    live = [
        a
        for a in anchors
        if not a.touch_in_flight and a.resident_blocks > 0 and a.demand >= cfg.min_demand
    ]
    due_age = cfg.safety_fraction * horizon_s if math.isfinite(horizon_s) else math.inf

    def is_due(a: AnchorView[K]) -> bool:
        return now - a.last_used_at >= due_age or a.allocated_since >= urgent_blocks

    kept = [a for a in live if a.held or is_due(a)]
    kept.sort(key=lambda a: (-a.demand / max(1, a.n_blocks), a.anchor_id))
    due, used = [], 0
    for a in kept:
        if used + a.n_blocks <= max_blocks:
            used += a.n_blocks
            if is_due(a):
                due.append(a)
    due.sort(key=lambda a: (a.last_used_at, a.anchor_id))
    return tuple(a.anchor_id for a in due[: max(0, slots)])
