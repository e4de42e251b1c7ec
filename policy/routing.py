"""Engine choice: filters -> weighted scorers in [0, 1] -> deterministic pick + failover order.

Filters: an engine must be healthy; it must not be overloaded (usage above ``max_usage`` or more
than ``max_waiting`` queued requests) unless every healthy engine is, in which case all healthy
engines stay candidates (overload is a preference, never a refusal).

Scorers, each in [0, 1]:

- ``affinity``: 1 on the engine the session last used (its KV lives there);
- ``parent``: 1 on the parent session's engine (a child shares the parent's prefix);
- ``prefix``: resident prefix blocks of this request / max(request blocks, best resident);
- ``load``: ``(1 - usage) / (1 + waiting / (running + 1))``.

Total = weighted mean of the scores. Ties break on the engine name, so the same inputs always
pick the same engine. The failover order is the remaining candidates by score, then the
overloaded healthy engines by score; unhealthy engines are never returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineCandidate:
    """One replica this tick: ``kv_cache_usage`` in [0, 1], queue sizes from its metrics, and
    ``resident_prefix_blocks``: leading blocks of this request resident there (residency index)."""

    name: str
    healthy: bool = True
    kv_cache_usage: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    resident_prefix_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """``prompt_blocks``: full blocks of the request's prompt (normalises the prefix score);
    ``affinity``: the session's last engine; ``parent_engine``: the parent session's engine."""

    prompt_blocks: int = 0
    affinity: str | None = None
    parent_engine: str | None = None


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Scorer weights (>= 0) and the overload thresholds of the filter."""

    affinity_weight: float = 3.0
    parent_weight: float = 2.0
    prefix_weight: float = 2.0
    load_weight: float = 1.0
    max_usage: float = 0.95
    max_waiting: float = 16.0

    def __post_init__(self) -> None:
        if min(self.affinity_weight, self.parent_weight, self.prefix_weight, self.load_weight) < 0:
            raise ValueError("weights must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineScore:
    """One candidate's scores (each in [0, 1]) and their weighted mean ``total``."""

    name: str
    affinity: float
    parent: float
    prefix: float
    load: float
    total: float
    overloaded: bool


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """``engine``: the pick (None when no engine is healthy); ``failover``: the rest to try in
    order; ``scores``: every healthy candidate, best first; ``reason``: the pick's strongest
    weighted scorer (affinity / parent / prefix / load), or ``no_healthy_engine``."""

    engine: str | None
    failover: tuple[str, ...]
    scores: tuple[EngineScore, ...]
    reason: str


def is_overloaded(c: EngineCandidate, config: RoutingConfig) -> bool:
    """The overload filter's test."""
    return c.kv_cache_usage > config.max_usage or c.waiting > config.max_waiting


def load_score(c: EngineCandidate) -> float:
    """``(1 - usage) / (1 + waiting / (running + 1))`` in [0, 1]."""
    free = 1.0 - min(1.0, max(0.0, c.kv_cache_usage))
    return free / (1.0 + max(0.0, c.waiting) / (max(0.0, c.running) + 1.0))


def score_engine(
    c: EngineCandidate, req: RouteRequest, best_resident: int, config: RoutingConfig
) -> EngineScore:
    """All scorers for one candidate; ``best_resident`` = max resident blocks over candidates."""
    affinity = 1.0 if req.affinity is not None and c.name == req.affinity else 0.0
    parent = 1.0 if req.parent_engine is not None and c.name == req.parent_engine else 0.0
    denom = max(req.prompt_blocks, best_resident, 1)
    prefix = min(1.0, max(0, c.resident_prefix_blocks) / denom)
    load = load_score(c)
    weights = (
        config.affinity_weight,
        config.parent_weight,
        config.prefix_weight,
        config.load_weight,
    )
    wsum = sum(weights) or 1.0
    total = (
        sum(w * s for w, s in zip(weights, (affinity, parent, prefix, load), strict=True)) / wsum
    )
    return EngineScore(c.name, affinity, parent, prefix, load, total, is_overloaded(c, config))


def _reason(s: EngineScore, config: RoutingConfig) -> str:
    parts = {
        "affinity": config.affinity_weight * s.affinity,
        "parent": config.parent_weight * s.parent,
        "prefix": config.prefix_weight * s.prefix,
        "load": config.load_weight * s.load,
    }
    return max(parts, key=lambda k: parts[k])  # dict order breaks ties: affinity first


def route(
    candidates: Sequence[EngineCandidate], req: RouteRequest, config: RoutingConfig | None = None
) -> RouteDecision:
    """Pick an engine for one request (module rules); O(n log n) in the candidates."""
    cfg = config or RoutingConfig()
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        return RouteDecision(None, (), (), "no_healthy_engine")
    best_resident = max(c.resident_prefix_blocks for c in healthy)
    scores = [score_engine(c, req, best_resident, cfg) for c in healthy]
    # Not-overloaded first, then best total, then name: the full ranking in one sort.
    scores.sort(key=lambda s: (s.overloaded, -s.total, s.name))
    names = tuple(s.name for s in scores)
    return RouteDecision(names[0], names[1:], tuple(scores), _reason(scores[0], cfg))


# --- placement by the request's own prompt (no session to follow) -------------------------------
@dataclass(frozen=True, slots=True)
class PrefixCandidate:
    """One replica for a request placed by its prompt: ``matched``: leading prompt chunks of
    this request it was sent before (likely still cached there); ``cached``: prompt chunks it
    was sent in all; ``pending``: prompt tokens sent to it whose prefill has not finished."""

    name: str
    healthy: bool = True
    matched: int = 0
    cached: int = 0
    pending: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefixPlacementConfig:
    """``miss_weight``: what a prompt token to compute costs against one already waiting in a
    replica's queue. 1: the replica where this request's prefill would finish first; above 1,
    a cached prefix is worth more than the wait (recomputing it elsewhere also takes space
    from that replica's cache)."""

    miss_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.miss_weight <= 0:
            raise ValueError("miss_weight must be > 0")


def place_by_prefix(
    candidates: Sequence[PrefixCandidate],
    chain_len: int,
    chunk_tokens: float,
    config: PrefixPlacementConfig | None = None,
) -> RouteDecision:
    """Pick a replica for a request of ``chain_len`` prompt chunks (``chunk_tokens`` each).

    Each healthy replica costs the prefill work queued there plus ``miss_weight`` x the tokens
    of this prompt it would compute (those past its matched prefix): the estimate of when this
    request's prefill would finish there. Lowest cost first; ties go to the longer match, then
    to the replica asked to hold less, then keep the order given. Under light load that is the
    longest match (cache affinity); when the replica holding a prefix has a queue longer than
    the prefix is worth, the request goes where it starts sooner and the prefix gets a second
    home. ``reason``: ``prefix`` (the pick has the longest match), ``load`` (a match was passed
    over for a shorter queue) or ``spread`` (no replica has any of it).
    """
    cfg = config or PrefixPlacementConfig()
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        return RouteDecision(None, (), (), "no_healthy_engine")

    def cost(c: PrefixCandidate) -> float:
        return c.pending + cfg.miss_weight * max(0, chain_len - c.matched) * chunk_tokens

    # sorted() is stable: full ties keep the caller's order (the runtime rotates it)
    ranked = sorted(healthy, key=lambda c: (cost(c), -c.matched, c.cached))
    best = max(c.matched for c in healthy)
    reason = "spread" if best == 0 else "prefix" if ranked[0].matched == best else "load"
    names = tuple(c.name for c in ranked)
    return RouteDecision(names[0], names[1:], (), reason)
