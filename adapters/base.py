"""The engine-adapter contract: every engine I/O kvkeeper does goes through one of these.

Exception tree::

    AdapterError            any failure talking to an engine or offload tier
    ├── EngineUnavailable   connection refused / reset / timed out
    ├── EngineRejected      the engine answered with an HTTP error (status kept)
    └── Unsupported         the adapter lacks the capability for this operation
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


class AdapterError(Exception):
    """Base of all adapter failures."""


class EngineUnavailable(AdapterError):
    """The engine could not be reached."""


class EngineRejected(AdapterError):
    """The engine answered with an HTTP error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine answered {status}: {message}")
        self.status = status


class Unsupported(AdapterError):
    """The adapter does not have the capability an operation needs."""


class Capability(StrEnum):
    """What an engine (plus its offload tier) lets kvkeeper do."""

    TOKENIZE = "tokenize"  # POST /tokenize
    KV_EVENTS = "kv_events"  # ZMQ BlockStored/BlockRemoved stream
    METRICS = "metrics"  # Prometheus /metrics with vLLM names
    TOUCH = "touch"  # max_tokens=1 re-touch / warm-up requests
    OFFLOAD = "offload"  # an offload tier that can store + pin a prefix
    PREFETCH = "prefetch"  # load a prefix back from the offload tier
    EVICT_OFFLOADED = "evict_offloaded"  # delete a prefix from the offload tier


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The engine's prefix-cache geometry (from config or ``vllm:cache_config_info``)."""

    block_size: int = 32
    num_blocks: int | None = None
    hash_algo: str = "sha256_cbor"
    hash_seed: str = "0"


@dataclass(frozen=True, slots=True)
class TouchResult:
    """Outcome of a ``max_tokens: 1`` request over a recorded context."""

    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def recomputed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


@dataclass(frozen=True, slots=True)
class HistogramReading:
    """One reading of a cumulative Prometheus histogram, summed across label sets."""

    sum: float
    count: float
    buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), +Inf last


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of the engine's Prometheus metrics (None when not exposed)."""

    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    external_prefix_cache_hits: float | None = None
    preemptions: float | None = None
    # two latency histograms that show the length of the engine's steps (policy.steps): a
    # request's time from its first scheduling to its first token, and between output tokens
    prefill_time: HistogramReading | None = None
    inter_token: HistogramReading | None = None
    cache_config: CacheConfig | None = None
    raw: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class EngineAdapter(Protocol):
    """One inference engine replica."""

    name: str
    base_url: str
    capabilities: frozenset[Capability]

    async def health(self) -> bool:
        """True when the engine answers its health route."""
        ...

    async def tokenize(self, route: str, body: dict[str, Any]) -> list[int]:
        """Token ids the engine will hash for this request body on this route."""
        ...

    async def touch(self, route: str, body: dict[str, Any]) -> TouchResult:
        """Re-send a recorded request with ``max_tokens: 1`` to refresh its prefix in LRU."""
        ...

    async def metrics(self) -> EngineMetrics:
        """Scrape the engine's metrics."""
        ...


@runtime_checkable
class OffloadTier(Protocol):
    """An offload tier addressed by token ids (LMCache's MP stack, or the simulator's CPU tier)."""

    async def lookup(self, token_ids: Sequence[int]) -> int:
        """Number of leading tokens stored in the tier."""
        ...

    async def pin(self, token_ids: Sequence[int]) -> int:
        """Pin the stored chunks of this prefix; returns chunks affected."""
        ...

    async def unpin(self, token_ids: Sequence[int]) -> int:
        """Undo :meth:`pin`."""
        ...

    async def delete(self, token_ids: Sequence[int]) -> int:
        """Delete the stored chunks of this prefix from every tier; returns chunks deleted."""
        ...
