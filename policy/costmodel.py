"""Keep vs offload vs drop for an idle session, and which predicted anchors to warm.

All costs are expected seconds of engine work over the retention window (TTL left, or 24 h for
``prompt_cache_retention: "24h"``); a resume after the window costs the same under every choice
and is left out. With ``p`` = P(resume within the window | idle for ``elapsed``) and ``m`` =
E[min(time to resume, window)] from the gap model::

    keep    = touches * touch_cost + pressure * hold_cost_per_block_s * n_blocks * m
              touches = m / (safety_fraction * horizon)   (0 with an unknown horizon)
    offload = store_cost + p * n_tokens * load_s_per_token        (only with an offload tier)
    drop    = p * n_tokens * prefill_s_per_token

The cheapest wins; ties prefer drop, then offload (freeing GPU blocks). ``expected_savings_s`` is
drop's cost minus the winner's. Long windows make ``keep`` pay GPU residency for a long ``m``,
so 24 h retention goes to the offload tier by itself.

Warm-up (CacheScout's prefetch): warming an anchor moves ``work`` seconds (load from the tier,
else recompute) off the critical path. If the anchor runs next (``p_next``) the work was needed
anyway and the latency is saved; otherwise it is wasted, and more so under pressure::

    gain = work * (p_next * latency_weight - (1 - p_next) * (1 + pressure))

Pure arithmetic; no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from policy.gaps import GapDistribution


class Retention(StrEnum):
    """What to do with an idle session's prefix."""

    KEEP = "keep"  # protect on GPU with touches
    OFFLOAD = "offload"  # store + pin in the offload tier, stop GPU protection
    DROP = "drop"  # let LRU take it


@dataclass(frozen=True, slots=True)
class CostParams:
    """Engine constants, in seconds of engine time.

    ``prefill_s_per_token``: recompute cost; ``load_s_per_token``: load from the offload tier;
    ``touch_cost_s``: one touch; ``offload_store_cost_s``: make sure the prefix is stored and
    pinned; ``hold_cost_s_per_block_s``: what holding one GPU block for one second costs other
    traffic at full pressure; ``safety_fraction``: as in keep-alive (touch interval / horizon).
    """

    prefill_s_per_token: float = 2.5e-3
    load_s_per_token: float = 2.5e-4
    touch_cost_s: float = 0.05
    offload_store_cost_s: float = 0.05
    hold_cost_s_per_block_s: float = 1e-4
    safety_fraction: float = 0.5


@dataclass(frozen=True, slots=True)
class IdleSession:
    """One idle session: prefix size, gap fit, time idle, the window wanted, the engine's
    horizon (``math.inf`` = unknown), the offload tier's presence and budget pressure [0, 1]."""

    n_tokens: int
    n_blocks: int
    gap: GapDistribution
    elapsed_s: float
    retention_s: float
    horizon_s: float
    has_offload_tier: bool
    pressure: float = 0.0


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    """The choice, each option's expected cost (``math.inf`` = unavailable), the savings over
    dropping, and ``p_resume`` within the window."""

    action: Retention
    keep_cost_s: float
    offload_cost_s: float
    drop_cost_s: float
    expected_savings_s: float
    p_resume: float


def option_costs(s: IdleSession, params: CostParams) -> tuple[float, float, float, float]:
    """``(keep, offload, drop, p_resume)`` expected costs for one idle session (module rules)."""
    p = s.gap.p_resume_within(s.retention_s, s.elapsed_s)
    m = s.gap.expected_wait_within(s.retention_s, s.elapsed_s)
    touches = m / (params.safety_fraction * s.horizon_s) if math.isfinite(s.horizon_s) else 0.0
    pressure = min(1.0, max(0.0, s.pressure))
    keep = (
        touches * params.touch_cost_s + pressure * params.hold_cost_s_per_block_s * s.n_blocks * m
    )
    offload = math.inf
    if s.has_offload_tier:
        offload = params.offload_store_cost_s + p * s.n_tokens * params.load_s_per_token
    drop = p * s.n_tokens * params.prefill_s_per_token
    return keep, offload, drop, p


def decide_retention(s: IdleSession, params: CostParams | None = None) -> RetentionDecision:
    """Keep, offload or drop: the cheapest expected cost (ties: drop, offload, keep)."""
    keep, offload, drop, p = option_costs(s, params or CostParams())
    # min() keeps the first of equal costs: the order is the tie-break.
    action, cost = min(
        ((Retention.DROP, drop), (Retention.OFFLOAD, offload), (Retention.KEEP, keep)),
        key=lambda ac: ac[1],
    )
    return RetentionDecision(action, keep, offload, drop, drop - cost, p)


@dataclass(frozen=True, slots=True)
class WarmCandidate:
    """An anchor the predictor may run next: ``p_next`` from the Markov model; ``n_tokens`` its
    prefix; ``resident_tokens`` leading tokens already on GPU; ``offloaded_tokens`` leading
    tokens in the offload tier."""

    anchor_id: str
    p_next: float
    n_tokens: int
    resident_tokens: int = 0
    offloaded_tokens: int = 0


def warm_work_s(c: WarmCandidate, params: CostParams) -> float:
    """Engine seconds a warm-up spends: load what the tier holds beyond GPU, recompute the rest."""
    resident = min(max(0, c.resident_tokens), c.n_tokens)
    tier_end = min(max(resident, c.offloaded_tokens), c.n_tokens)
    loaded = tier_end - resident
    recomputed = c.n_tokens - tier_end
    return loaded * params.load_s_per_token + recomputed * params.prefill_s_per_token


def warm_gain_s(
    c: WarmCandidate, params: CostParams, pressure: float = 0.0, latency_weight: float = 1.0
) -> float:
    """Expected net gain of warming ``c`` now (module formula); > 0 means worth it."""
    p = min(1.0, max(0.0, c.p_next))
    pressure = min(1.0, max(0.0, pressure))
    return warm_work_s(c, params) * (p * latency_weight - (1.0 - p) * (1.0 + pressure))


def plan_warmups(
    candidates: Sequence[WarmCandidate],
    params: CostParams | None = None,
    pressure: float = 0.0,
    max_warmups: int = 1,
    latency_weight: float = 1.0,
) -> tuple[str, ...]:
    """Anchors to warm now: positive gain only, best first (ties by id), at most ``max_warmups``."""
    prm = params or CostParams()
    gains = [(warm_gain_s(c, prm, pressure, latency_weight), c.anchor_id) for c in candidates]
    positive = sorted(((g, a) for g, a in gains if g > 0), key=lambda ga: (-ga[0], ga[1]))
    return tuple(a for _, a in positive[: max(0, max_warmups)])
