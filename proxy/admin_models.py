"""The models of the admin REST answers (``/admin/sessions``, ``/admin/sessions/{id}``,
``/admin/engines``), of the probes and of a management request's answer: the handlers build their
JSON from them and ``proxy/openapi.py`` describes the routes with their JSON schemas. The
console's own answers are in ``proxy/console_models.py``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.console_models import TierPins
from proxy.store_model import Session


class SessionCounters(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    touches: int = Field(default=0, description="keep-alive touches sent for its prefix")
    touch_tokens: int = 0
    warmups: int = Field(default=0, description="re-sends that rebuilt a lost prefix")
    warmup_tokens: int = 0
    expiries: int = 0


class SessionRecord(BaseModel):
    session_id: str
    tenant: str
    state: str = Field(description="active | protected | idle | offloaded")
    parent_session_id: str | None
    children: list[str]
    agent: str | None
    engine: str | None = Field(description="the engine its prefix lives on (None: not routed)")
    created: float = Field(description="epoch seconds")
    last_seen: float = Field(description="epoch seconds")
    ttl_s: float = Field(description="its protection TTL: asked by the client, or guessed")
    ttl_guessed: bool = Field(
        description="the TTL is kvkeeper's guess from its returns (retention.return_ttl_factor), "
        "ranked after the TTLs clients asked for"
    )
    ttl_left_s: float
    retention: str = Field(description="its retention class")
    counters: SessionCounters
    context_bytes: int = Field(description="compressed context kept to re-send its prompt")
    last_used: float | None = Field(description="epoch seconds; None: never served")
    last_touch: float | None = Field(description="epoch seconds; None: never touched")

    @classmethod
    def of(cls, s: Session, now: float) -> SessionRecord:
        return cls(
            session_id=s.session_id,
            tenant=s.tenant,
            state=s.state,
            parent_session_id=s.parent,
            children=list(s.children),
            agent=s.agent,
            engine=s.engine,
            created=s.created,
            last_seen=s.last_seen,
            ttl_s=s.ttl,
            ttl_guessed=s.guessed,
            ttl_left_s=round(s.ttl_left(now), 3),
            retention=s.retention,
            counters=SessionCounters(**s.counters),
            context_bytes=s.context_bytes,
            last_used=s.last_used or None,
            last_touch=s.last_touch or None,
        )


class SessionPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionRecord]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page")


class SessionTreeNode(BaseModel):
    session_id: str
    state: str
    children: list[SessionTreeNode] = Field(default_factory=list)


class EngineResidency(BaseModel):
    resident_prefix_blocks: dict[str, int] = Field(
        description="per medium (GPU, CPU...): leading blocks of its prompt resident"
    )


class SessionResidency(BaseModel):
    blocks: int = Field(description="KV blocks in the session's prompt")
    engines: dict[str, EngineResidency]


class SessionView(SessionRecord):
    tree: SessionTreeNode = Field(description="its subtree, breadth first, bounded")
    residency: SessionResidency | None = Field(description="None: retention is off")


# built from the internal views' dicts: a key added there without a field here fails loudly
_EXACT = ConfigDict(extra="forbid")


class OverheadView(BaseModel):
    model_config = _EXACT

    max_share: float
    earned_from: str = Field(description="engine (its query counter) | proxy (forwarded traffic)")
    credit_tokens: float
    touch_estimate_tokens: float
    recomputed_tokens: int
    forgiven_tokens: int = Field(
        description="recompute beyond the one bucket of debt an accident may leave (the "
        "guard is charged with it)"
    )
    declined: int


class GuardView(BaseModel):
    model_config = _EXACT

    state: str
    balance_tokens: float
    cost_tokens: float
    bought_tokens: float
    total_cost_tokens: float
    total_bought_tokens: float
    within_horizon_tokens: float = Field(
        description="hits retention kept for resumes within the LRU horizon (plain LRU would "
        "have kept them: not credited), decaying like bought_tokens"
    )
    total_within_horizon_tokens: float
    resumes_credited: int = Field(description="resumes after a pause beyond the LRU horizon")
    resumes_within_horizon: int
    backoffs: int
    backed_off_for_s: float
    next_cooldown_s: float
    enabled: bool
    workers_scale: int
    sessions_kept: int


class KvEventsView(BaseModel):
    model_config = _EXACT

    subscribed: bool = Field(description="this process follows the engine's KV events itself")
    source: str | None = Field(
        description="own (this process holds the engine's lease), relay (the holder's relay), "
        "None: no KV events"
    )
    relayed_batches: int = Field(description="event batches learned from the holder's relay")


class RetentionView(BaseModel):
    model_config = _EXACT

    mode: str = Field(description="events | feedback")
    kv_events: KvEventsView
    horizon_s: float | None = Field(description="the LRU horizon; None: unbounded")
    horizon_source: str
    block_size: int
    pool_blocks: int | None
    resident_blocks: dict[str, int] = Field(description="blocks kvkeeper sees per medium")
    overhead: OverheadView
    mode_note: str
    leader: bool
    offload_tier: bool
    tier_pinned: TierPins | None
    touches_in_flight: int
    touch_latency_s: float
    touch_trimmed_blocks: int
    guard: GuardView | None
    scheduling_policy: str | None
    admission_priorities: bool
    pressure_overrides_now: int


class HashCheckView(BaseModel):
    status: str = Field(description="pending | ok | mismatch | no_events")
    detail: str | None
    checked_at: float | None


class EngineRecord(BaseModel):
    name: str
    url: str
    healthy: bool
    inflight: int
    last_error: str | None
    last_check: float | None = Field(description="epoch seconds of the last health check")
    models: list[str]
    events: str | None = Field(description="its KV events endpoint; None: feedback only")
    retention: RetentionView | None = Field(description="None: retention is off")
    hash_check: HashCheckView | None


class EngineList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EngineRecord]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    ready: bool = Field(description="at least one engine passed its last health check")
    engines_ready: int
    engines_total: int
    redis: bool = Field(description="the session store answers (does not gate readiness)")
    engines: dict[str, bool] | None = Field(
        default=None,
        description="per engine address: healthy; only for the admin token or expose_engines",
    )


class EditOutcome(BaseModel):
    type: str = Field(description="offload | prefetch | evict")
    status: str = Field(description="applied | unsupported | rejected | failed")
    block_start: int | None = None
    block_end: int | None = None
    reason: str | None = None
    detail: dict[str, Any] | None = None


class ManagementResult(BaseModel):
    """The answer to a ``manage_request: true`` hint: its edits ran, no model was called."""

    object: Literal["kvkeeper.management"] = "kvkeeper.management"
    session_id: str
    results: list[EditOutcome]
