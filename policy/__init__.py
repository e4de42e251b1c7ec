"""Pure decisions (no I/O): TTL budget, keep-alive schedule, routing, prediction.

Modules: ``horizon`` (LRU horizon estimate), ``keepalive`` (touch schedule), ``budget`` (soft-TTL
budget, pressure overrides), ``routing`` (engine choice), ``overhead`` (what touches and
warm-ups may recompute), ``admission`` (engine priorities), ``steps`` (the engine's step length from a latency
histogram), ``tier_pins`` (what to pin in the offload tier), ``smoothing`` (EWMA), ``returns`` (protection
of sessions that return without a TTL). Time is
always passed in as ``now``; nothing here reads a clock.
"""

from policy.budget import (
    BudgetConfig,
    BudgetDecision,
    BudgetSession,
    EngineLoad,
    allocate_budget,
    effective_budget,
    load_pressure,
    plan_budget,
    session_value,
)
from policy.horizon import (
    UNKNOWN_HORIZON,
    HorizonConfig,
    HorizonEstimate,
    HorizonEstimator,
    HorizonSource,
    weighted_quantile,
)
from policy.ids import SessionId
from policy.keepalive import (
    KeepaliveConfig,
    KeepalivePlan,
    ProtectedSession,
    expected_touch_rate,
    plan_touches,
    touch_cost_tokens,
    touch_extent,
    touch_interval,
)
from policy.overhead import OverheadBudget, OverheadConfig
from policy.returns import ReturnWindow, ReturnWindowConfig
from policy.routing import (
    EngineCandidate,
    EngineScore,
    RouteDecision,
    RouteRequest,
    RoutingConfig,
    is_overloaded,
    load_score,
    route,
    score_engine,
)
from policy.smoothing import Ewma, ewma
from policy.steps import step_seconds, window_counts
from policy.tier_pins import PinCandidate, pin_budget, plan_pins

__all__ = [
    "UNKNOWN_HORIZON",
    "BudgetConfig",
    "BudgetDecision",
    "BudgetSession",
    "EngineCandidate",
    "EngineLoad",
    "EngineScore",
    "Ewma",
    "HorizonConfig",
    "HorizonEstimate",
    "HorizonEstimator",
    "HorizonSource",
    "KeepaliveConfig",
    "KeepalivePlan",
    "OverheadBudget",
    "OverheadConfig",
    "PinCandidate",
    "ProtectedSession",
    "ReturnWindow",
    "ReturnWindowConfig",
    "RouteDecision",
    "RouteRequest",
    "RoutingConfig",
    "SessionId",
    "allocate_budget",
    "effective_budget",
    "ewma",
    "expected_touch_rate",
    "is_overloaded",
    "load_pressure",
    "load_score",
    "pin_budget",
    "plan_budget",
    "plan_pins",
    "plan_touches",
    "route",
    "score_engine",
    "session_value",
    "step_seconds",
    "touch_cost_tokens",
    "touch_extent",
    "touch_interval",
    "weighted_quantile",
    "window_counts",
]
