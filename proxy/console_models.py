"""The models of the console's admin JSON (and of the admin actions it calls): the handlers
return them and ``proxy/openapi.py`` describes the routes with their JSON schemas."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ConsoleCounters(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    touches: int = 0
    warmups: int = 0
    expiries: int = 0
    hit_rate: float | None = Field(default=None, description="cached_tokens / prompt_tokens")


class ConsoleSession(BaseModel):
    session_id: str
    tenant: str
    state: str = Field(description="active | protected | idle | offloaded")
    display_state: str = Field(
        description="state, or 'expired' for an idle session whose TTL ran out"
    )
    parent_session_id: str | None
    agent: str | None
    engine: str | None
    created: float
    last_seen: float
    ttl_s: float
    ttl_guessed: bool = Field(description="the TTL is kvkeeper's guess, not the client's")
    ttl_until: float = Field(description="epoch seconds; 0 when not protected")
    ttl_left_s: float
    blocks: int | None = Field(description="KV blocks of its prefix (None: not learned yet)")
    gpu_blocks: int | None = Field(description="leading blocks resident on its engine's GPU")
    tier_blocks: int | None = Field(description="leading blocks in its engine's offload tier")
    tier_pinned: bool = Field(description="its prefix is pinned in an offload tier")
    matched: bool = Field(description="matches the search (all do without one)")
    counters: ConsoleCounters


class ForestNode(BaseModel):
    session: ConsoleSession
    children: list[ForestNode] = Field(default_factory=list)
    hidden_children: int = Field(default=0, description="children not shown (page node bound)")


class ForestPage(BaseModel):
    object: str = "kvkeeper.console.forest"
    now: float
    tenant: str | None = Field(description="the tenant shown; None: every tenant")
    total_sessions: int
    total_trees: int = Field(description="trees that match the search and state filter")
    matched_sessions: int
    states: dict[str, int] = Field(description="sessions per display state, before filtering")
    offset: int
    limit: int
    trees: list[ForestNode]


class SessionDetail(BaseModel):
    object: str = "kvkeeper.console.session"
    session: ConsoleSession
    children: list[str]
    context_bytes: int = Field(description="compressed context kept to re-send its prompt")
    last_used: float | None
    last_touch: float | None
    residency: dict[str, dict[str, int]] = Field(
        description="per engine: leading blocks of its prefix resident per medium (GPU, CPU...)"
    )


class SeriesPoint(BaseModel):
    t: float
    requests: int = Field(description="requests forwarded to the engine since the last point")
    hit_rate: float | None = Field(description="cached / prompt tokens of those requests")
    ttft_s: float | None = Field(description="their mean time to first byte")
    kv_cache_usage: float | None
    inflight: int
    horizon_s: float | None


class EngineLoadView(BaseModel):
    pool_blocks: int
    kv_cache_usage: float | None
    waiting: float | None
    running: float | None


class RetentionCredit(BaseModel):
    max_share: float
    credit_tokens: float
    recomputed_tokens: int
    declined: int


class TierPins(BaseModel):
    sessions: int
    chunks: int
    capacity_chunks: int | None


class ConsoleEngine(BaseModel):
    name: str
    url: str
    healthy: bool
    inflight: int
    last_error: str | None
    retention: bool = Field(description="the retention layer drives this engine")
    mode: str | None = Field(description="events | feedback")
    leader: bool | None
    horizon_s: float | None = Field(description="the LRU horizon: how long an idle prefix lasts")
    horizon_source: str | None
    load: EngineLoadView | None
    resident_blocks: dict[str, int]
    protected_sessions: int
    credit: RetentionCredit | None
    touches: dict[str, int] = Field(description="keep-alive touches by outcome")
    tier: TierPins | None
    hit_rate: float | None = Field(description="over the series window")
    series: list[SeriesPoint]


class ConsoleEngines(BaseModel):
    object: str = "kvkeeper.console.engines"
    now: float
    sample_every_s: float
    engines: list[ConsoleEngine]


class Freed(BaseModel):
    object: str = "kvkeeper.freed"
    freed: list[str] = Field(description="freed ids in the order they were freed")


class OperationOutcome(BaseModel):
    object: str = "kvkeeper.operation"
    operation: str
    type: str
    status: str = Field(description="applied | unsupported | rejected | failed")
    reason: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)
    block_start: int | None = None
    block_end: int | None = None
