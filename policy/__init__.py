"""Pure decisions (no I/O): TTL budget, keep-alive schedule, routing, prediction.

Modules: ``horizon`` (LRU horizon estimate), ``keepalive`` (touch schedule), ``budget`` (soft-TTL
budget, pressure overrides), ``tree`` (parent/child rules), ``routing`` (engine choice),
``overhead`` (what touches and warm-ups may recompute), ``predictor`` (next-agent Markov
model), ``gaps`` (time-to-resume model), ``costmodel`` (keep / offload / drop, warm-ups),
``steps`` (the engine's step length from a latency histogram), ``tier_pins`` (what to pin in
the offload tier). Time is always passed in as ``now``; nothing here reads a clock.
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
from policy.costmodel import (
    CostParams,
    IdleSession,
    Retention,
    RetentionDecision,
    WarmCandidate,
    decide_retention,
    option_costs,
    plan_warmups,
    warm_gain_s,
    warm_work_s,
)
from policy.gaps import ANY, GapConfig, GapDistribution, GapModel
from policy.horizon import (
    UNKNOWN_HORIZON,
    HorizonConfig,
    HorizonEstimate,
    HorizonEstimator,
    HorizonSource,
    weighted_quantile,
)
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
from policy.predictor import TransitionConfig, TransitionModel
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
from policy.steps import step_seconds, window_counts
from policy.tier_pins import PinCandidate, anchor_next_use_s, pin_budget, plan_pins
from policy.tree import (
    TreeNode,
    children_index,
    free_order,
    post_order,
    protection_deadlines,
    releasable_blocks,
    release_on_end,
)

__all__ = [
    "ANY",
    "UNKNOWN_HORIZON",
    "BudgetConfig",
    "BudgetDecision",
    "BudgetSession",
    "CostParams",
    "EngineCandidate",
    "EngineLoad",
    "EngineScore",
    "GapConfig",
    "GapDistribution",
    "GapModel",
    "HorizonConfig",
    "HorizonEstimate",
    "HorizonEstimator",
    "HorizonSource",
    "IdleSession",
    "KeepaliveConfig",
    "KeepalivePlan",
    "OverheadBudget",
    "OverheadConfig",
    "PinCandidate",
    "ProtectedSession",
    "Retention",
    "RetentionDecision",
    "RouteDecision",
    "RouteRequest",
    "RoutingConfig",
    "TransitionConfig",
    "TransitionModel",
    "TreeNode",
    "WarmCandidate",
    "allocate_budget",
    "anchor_next_use_s",
    "children_index",
    "decide_retention",
    "effective_budget",
    "expected_touch_rate",
    "free_order",
    "is_overloaded",
    "load_pressure",
    "load_score",
    "option_costs",
    "pin_budget",
    "plan_budget",
    "plan_pins",
    "plan_touches",
    "plan_warmups",
    "post_order",
    "protection_deadlines",
    "releasable_blocks",
    "release_on_end",
    "route",
    "score_engine",
    "session_value",
    "step_seconds",
    "touch_cost_tokens",
    "touch_extent",
    "touch_interval",
    "warm_gain_s",
    "warm_work_s",
    "weighted_quantile",
    "window_counts",
]
