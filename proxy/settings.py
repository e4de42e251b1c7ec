"""Service settings: one validated value, built from defaults < YAML file < environment < CLI flags.

Environment variables use the ``KVKEEPER_`` prefix (``KVKEEPER_REDIS_URL``, ``KVKEEPER_ADMIN_TOKEN``,
``KVKEEPER_PORT`` ...); nested limits use ``__`` (``KVKEEPER_LIMITS__MAX_TTL_S=600``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from adapters.registry import kinds
from proxy.redisconn import (
    CLUSTER_SCHEMES,
    SCHEMES,
    SENTINEL_SCHEMES,
    parse_cluster_url,
    parse_sentinel_url,
)
from proxy.settings_compat import LEGACY_RETENTION_KEYS, migrate


class ConfigError(Exception):
    """Settings that cannot start the service; the message says which and why."""


class OffloadTierSpec(BaseModel):
    """An LMCache multi-process stack beside an engine (coordinator + MP server HTTP APIs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coordinator_url: str = Field(description="LMCache coordinator HTTP API.")
    server_url: str = Field(description="LMCache MP server HTTP API.")
    model_name: str = Field(description="The engine's --model value: LMCache keys carry it.")


class EngineSpec(BaseModel):
    """One engine replica: its HTTP base URL and, optionally, its KV-event endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="The engine's HTTP base URL (http://host:port).")
    kind: str = Field(default="vllm", description="Which engine adapter talks to it.")
    events: str | None = Field(
        default=None, description="tcp://host:port of its KV-event socket (null: discover)."
    )
    name: str | None = Field(
        default=None, description="Label in metrics and views (default host:port)."
    )
    lmcache: OffloadTierSpec | None = Field(default=None, description="Its offload tier, if any.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"engine url must look like http://host:port, got {v!r}")
        return v.rstrip("/")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in kinds():
            raise ValueError(f"unknown engine kind {v!r}; known: {', '.join(sorted(kinds()))}")
        return v

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

    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="Largest request body.")
    header_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="A connection idle, or with its request line and headers half sent, this "
        "long is closed (slowloris). It is also the keep-alive idle timeout: a load balancer "
        "that pools connections to kvkeeper must idle them out sooner.",
    )
    max_ttl_s: float = Field(
        default=3600.0, gt=0, description="Longest protection a hint may ask for."
    )
    max_retain_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="Retention beyond max_ttl_s (prompt_cache_retention 24h), kept in the offload tier.",
    )
    default_ttl_s: float = Field(
        default=300.0, ge=0, description="TTL of prompt_cache_retention=in_memory."
    )
    max_sessions_per_tenant: int = Field(
        default=10_000, gt=0, description="Live sessions per tenant."
    )
    # fixed bounds (not settings)
    max_inflight_body_bytes: ClassVar[int] = 512 * 1024 * 1024  # all bodies in memory (503)
    body_timeout_s: ClassVar[float] = 60.0  # the whole request body (408)
    max_children: ClassVar[int] = 256  # child sessions per session
    max_edits: ClassVar[int] = 16  # context edits per request
    max_context_bytes: ClassVar[int] = 4 * 1024 * 1024  # a recorded context, compressed
    max_session_id_len: ClassVar[int] = 256
    idle_expiry_s: ClassVar[int] = 24 * 3600  # Redis EXPIRE safety net of an idle session


class UpstreamSettings(BaseModel):
    """The shared aiohttp client towards the engines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout_s: ClassVar[float] = 3.0  # per engine request
    read_timeout_s: ClassVar[float] = 600.0  # between bytes before the first: long prefills
    stream_stall_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Once an answer has started, an engine silent this long has failed.",
    )
    api_key: str | None = Field(
        default=None, description="Sent to the engines instead of the client's Authorization."
    )


class RetentionSettings(BaseModel):
    """The retention worker: keep-alive touches before LRU, expiry, the soft-TTL budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Run the retention worker at all.")
    tick_s: float = Field(
        default=0.5,
        gt=0,
        description="Seconds between retention ticks (more while ticks run slow).",
    )
    budget_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Protected blocks at most this share of the engine's pool.",
    )
    return_ttl_factor: float = Field(
        default=2.0,
        ge=0,
        le=100,
        description="A session that returns without a TTL hint is protected for this many "
        "times the median pause before sessions' first returns, learned online "
        "(policy/returns.py), ranked after the TTLs clients ask (0: off).",
    )
    max_overhead_share: float | None = Field(
        default=0.01,
        gt=0,
        le=1,
        description="What touches and warm-ups may recompute, as a share of the prompt tokens served (null: unbounded).",
    )


class CacheSettings(BaseModel):
    """The engines' prefix-cache geometry, as their KV-event block hashes need it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int | None = Field(
        default=None,
        gt=0,
        description="Tokens per KV block (null: discover from /metrics, else 32).",
    )
    hash_seed: str = Field(default="0", description="The engines' PYTHONHASHSEED (block hashes).")


class TierSettings(BaseModel):
    """Pins of protected sessions in an engine's offload tier (engines[].lmcache)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pin_share: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of the tier's capacity pins may hold, on engines with a tier (0: off).",
    )


class GuardSettings(BaseModel):
    """The retention guard (policy/guard.py): per engine, retention's recompute (weighted by
    the queue it delayed) and tier loads against the hits it bought; below zero it backs off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Measure retention's effect and back off.")
    # fixed (not settings): how fast old cost and hits stop counting, the weighted cost seen
    # before it may judge, cost per recomputed token per request then waiting, first back-off
    half_life_s: ClassVar[float] = 60.0
    min_evidence_tokens: ClassVar[float] = 8192.0
    queue_weight: ClassVar[float] = 1.0
    cooldown_s: ClassVar[float] = 30.0


class AdmissionSettings(BaseModel):
    """Cache-aware admission order: an engine priority stamped on every forwarded request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool | None = Field(
        default=None,
        description="Stamp priorities (null: on for engines that report a priority scheduling policy).",
    )


class PlacementSettings(BaseModel):
    """Where a request goes when there are several engines (``policy.routing.place_by_prefix``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: bool = Field(
        default=True,
        description="Share the prefix index with the other replicas and workers (Redis pub/sub).",
    )


# What ``retention:`` (or a bench target's ``@key=value``) accepts: its fields and legacy names.
RETENTION_KEYS = frozenset(RetentionSettings.model_fields) | frozenset(LEGACY_RETENTION_KEYS)


class Settings(BaseSettings):
    """Everything ``kvkeeper serve`` needs."""

    model_config = SettingsConfigDict(
        env_prefix="KVKEEPER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = Field(default="0.0.0.0", description="Listen address.")
    port: int = Field(default=8000, ge=0, le=65535, description="Listen port.")
    engines: list[EngineSpec] = Field(default_factory=list, description="The engine replicas.")
    redis_url: str | None = Field(
        default=None, description="redis://, rediss:// or unix:// (null: embedded private Redis)."
    )
    admin_token: str | None = Field(default=None, description="Bearer token of the admin API.")
    expose_engines: bool = Field(
        default=False,
        description="Engine addresses in X-KVKeeper-Engine and /readyz for every caller (else admin only).",
    )
    tenants_file: Path | None = Field(default=None, description="YAML mapping API keys to tenants.")
    namespace: str = Field(default="kvk", description="Prefix of every Redis key.")
    health_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between health checks."
    )
    limits: Limits = Field(default_factory=Limits)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    tier: TierSettings = Field(default_factory=TierSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    guard: GuardSettings = Field(default_factory=GuardSettings)
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING ...")
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one object per line."
    )
    access_log: bool = Field(default=True, description="One line per request (off saves its CPU).")
    workers: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Processes sharing the port (null: the usable cores or the container's CPU limit, at most 4).",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return migrate(data)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.engines:
            raise ValueError("at least one engine is required (--engine http://host:port)")
        if self.redis_url is not None and not self.redis_url.startswith(SCHEMES):
            raise ValueError(
                "redis url must be redis://, rediss://, unix://, "
                "redis+sentinel://host:port[,host:port]/service or "
                f"redis-cluster://host:port[,host:port], got {self.redis_url!r}"
            )
        if self.redis_url is not None and self.redis_url.startswith(SENTINEL_SCHEMES):
            parse_sentinel_url(self.redis_url)  # a ValueError says what is wrong
        if self.redis_url is not None and self.redis_url.startswith(CLUSTER_SCHEMES):
            parse_cluster_url(self.redis_url)
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
