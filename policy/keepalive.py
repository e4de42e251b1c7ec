"""Touch scheduling: which protected sessions to re-touch now, before LRU reaches them.

A touch is a ``max_tokens: 1`` request over the session's recorded context. It moves the
session's blocks to the most-recently-used end of vLLM's free queue, and since the prefix is
still cached it recomputes only the uncached tail (at most one block): cheap insurance.

Rules applied by :func:`plan_touches`, in order:

1. a session whose ``ttl_until`` has passed is expired, never touched;
2. a session with a touch in flight is skipped; its touch occupies a concurrency slot (even
   when the session has just expired);
3. a session is due when ``age >= safety_fraction * horizon`` (age = now - last use or touch);
   with an unknown horizon nothing is due unless ``unknown_horizon_interval_s`` is set;
4. due sessions the client protected come before ``guessed`` ones (protected by kvkeeper's
   guess, ``policy.returns``), so a guess only takes the slots the client's sessions leave;
   within each, sessions still inside the horizon come first, oldest first (closest to
   eviction), then higher value, then session id; sessions already past the horizon (probably
   evicted, so a touch re-prefills all their blocks) come after them, most valuable first;
5. at most ``max_concurrent_touches`` touches run at once; the rest are reported as deferred.

Pure: ``now`` is an argument, nothing does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policy.ids import SessionId


@dataclass(frozen=True, slots=True)
class ProtectedSession:
    """One protected session as the retention worker sees it this tick.

    ``last_active_at``: last use or touch (epoch seconds); ``ttl_until``: protection deadline;
    ``n_blocks``: blocks of its recorded prefix; ``value``: priority weight (higher = keep first,
    e.g. from :func:`policy.budget.session_value`); ``guessed``: protected by kvkeeper's guess,
    not by the client.
    """

    session_id: SessionId
    last_active_at: float
    ttl_until: float
    n_blocks: int
    touch_in_flight: bool = False
    value: float = 1.0
    guessed: bool = False


@dataclass(frozen=True, slots=True)
class KeepaliveConfig:
    """``safety_fraction``: touch once a session has used this share of the horizon;
    ``max_concurrent_touches``: cap on touches in flight per engine;
    ``unknown_horizon_interval_s``: touch interval while no eviction has been seen (None = never,
    since without evictions nothing is being lost)."""

    safety_fraction: float = 0.5
    max_concurrent_touches: int = 4
    unknown_horizon_interval_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.safety_fraction <= 1.0:
            raise ValueError("safety_fraction must be within (0, 1]")
        if self.max_concurrent_touches < 1:
            raise ValueError("max_concurrent_touches must be >= 1")


@dataclass(frozen=True, slots=True)
class KeepalivePlan:
    """Decisions of one tick.

    ``touch``: session ids to touch now, most urgent first; ``expire``: ids past their TTL;
    ``deferred``: due but over the concurrency cap (touch next tick); ``likely_lost``: the subset
    of ``touch`` + ``deferred`` already older than the horizon; ``next_due_at``: the earliest
    time a session not yet due becomes due (``math.inf`` if none), for sleeping until then.
    """

    touch: tuple[SessionId, ...]
    expire: tuple[SessionId, ...]
    deferred: tuple[SessionId, ...]
    likely_lost: tuple[SessionId, ...]
    next_due_at: float


def touch_interval(horizon_s: float, config: KeepaliveConfig) -> float:
    """Seconds between touches of one idle session (``math.inf`` = never touch)."""
    if math.isfinite(horizon_s):
        return config.safety_fraction * horizon_s
    return (
        math.inf if config.unknown_horizon_interval_s is None else config.unknown_horizon_interval_s
    )


def plan_touches(
    sessions: Sequence[ProtectedSession],
    horizon_s: float,
    now: float,
    config: KeepaliveConfig | None = None,
) -> KeepalivePlan:
    """Decide this tick's touches and expiries; O(n log n) in the number of sessions."""
    cfg = config or KeepaliveConfig()
    interval = touch_interval(horizon_s, cfg)
    expire: list[SessionId] = []
    savable: list[ProtectedSession] = []
    lost: list[ProtectedSession] = []
    in_flight = 0
    next_due = math.inf
    for s in sessions:
        # A touch in flight loads the engine even if its session has just expired.
        in_flight += s.touch_in_flight
        if now >= s.ttl_until:
            expire.append(s.session_id)
            continue
        if s.touch_in_flight:
            continue
        due_at = s.last_active_at + interval
        if now < due_at:
            # A touch due after the TTL ends is never needed.
            if due_at < s.ttl_until:
                next_due = min(next_due, due_at)
            continue
        (lost if now - s.last_active_at >= horizon_s else savable).append(s)
    savable.sort(key=lambda s: (s.last_active_at, -s.value, s.session_id))
    lost.sort(key=lambda s: (-s.value, s.last_active_at, s.session_id))
    ranked = (*savable, *lost)
    ordered = [s.session_id for s in ranked if not s.guessed]
    ordered += [s.session_id for s in ranked if s.guessed]
    slots = max(0, cfg.max_concurrent_touches - in_flight)
    return KeepalivePlan(
        touch=tuple(ordered[:slots]),
        expire=tuple(sorted(expire)),
        deferred=tuple(ordered[slots:]),
        likely_lost=tuple(s.session_id for s in lost),
        next_due_at=next_due,
    )


def touch_extent(n_blocks: int, resident: int, allocation_rate: float, latency_s: float) -> int:
    """How many leading blocks of a prefix a touch re-sends (0: none worth touching).

    LRU takes a freed prefix tail first (vLLM frees a request's blocks in reverse order), so a
    prefix that has lost blocks (``resident < n_blocks``) has the allocation front inside it:
    until the touch is scheduled, ``latency_s`` from now, the front takes about
    ``allocation_rate * latency_s`` more of its blocks. Re-sending those would re-prefill them,
    a warm-up at the cost of a congested engine rather than a touch; stopping short of them
    keeps the touch at one recomputed token. A prefix still whole is sent whole (how far the
    front is from its tail is not known).
    """
    if resident <= 0 or n_blocks <= 0:
        return 0
    if resident >= n_blocks:
        return n_blocks
    return max(0, resident - math.ceil(max(0.0, allocation_rate) * max(0.0, latency_s)))


def touch_cost_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens a touch recomputes when the prefix is still cached: the uncached tail.

    vLLM caches whole blocks only and always computes at least the last prompt token, so the
    cached part is ``floor((n - 1) / block_size)`` blocks and the rest (1..block_size tokens)
    is recomputed (verified: a 2,017-token context touched with 2,016 cached tokens).
    """
    if prompt_tokens <= 0:
        return 0
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    return prompt_tokens - ((prompt_tokens - 1) // block_size) * block_size


def expected_touch_rate(
    n_sessions: int, horizon_s: float, config: KeepaliveConfig | None = None
) -> float:
    """Touches per second needed to keep ``n_sessions`` idle sessions alive (0 if never)."""
    interval = touch_interval(horizon_s, config or KeepaliveConfig())
    if n_sessions <= 0 or not math.isfinite(interval):
        return 0.0
    return n_sessions / max(interval, 1e-9)
