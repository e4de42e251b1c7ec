"""The engine-adapter contract: every engine I/O kvkeeper does goes through one of these.

Exception tree::

    AdapterError            any failure talking to an engine or offload tier
    ├── EngineUnavailable   connection refused / reset / timed out
    ├── EngineRejected      the engine answered with an HTTP error (status kept)
    └── Unsupported         the adapter lacks the capability for this operation
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class BlockChain:
    """A token sequence's full-block ids and the engine's chained value after each block
    (opaque to callers): a sequence that grew from it hashes only its new blocks."""

    tokens: Sequence[int]
    cache_salt: Any
    ids: list[int]
    links: Sequence[Any]
    scheme: Any = None  # what the links were hashed with (block size, seed): reused only under it


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


class EventSink(Protocol):
    """Where decoded KV-event batches go (the residency index, the horizon tap)."""

    def apply(self, batch: Any) -> None: ...

    def clear(self) -> None: ...


class EventSubscription(Protocol):
    """A running KV-event subscription; closed when retention stops. ``sink`` may be wrapped
    while it runs; ``token_ids``: decode stored blocks' token ids too (the hash self-check)."""

    sink: EventSink
    token_ids: bool

    async def aclose(self) -> None: ...


@runtime_checkable
class EngineAdapter(Protocol):
    """One inference engine replica: everything engine-specific kvkeeper needs from it.

    proxy/ is typed against this protocol only; ``adapters.registry`` builds one per
    ``EngineSpec.kind``.
    """

    name: str
    base_url: str
    cache: CacheConfig  # block size, pool size, hash seed (updated by ``discover``)
    priority_header: str | None  # request header carrying a scheduling priority (None: none)
    priority_field: str  # the body field a client sets its own priority with
    hop_by_hop: frozenset[str]  # headers never forwarded, either direction (lower case)
    health_routes: tuple[str, ...]  # tried in order; 404 moves on to the next
    prioritized: bool  # requests and touches carry an admission priority (see priority_header)

    def tokenizable(self, route: str) -> bool:
        """Whether requests on ``route`` can be tokenized (and touched by token ids)."""
        ...

    def hash_blocks(self, token_ids: Sequence[int], *, cache_salt: Any = None) -> list[int]:
        """The ids the engine's KV events give the full blocks of ``token_ids``."""
        ...

    async def hash_chain_async(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: Any = None,
        previous: BlockChain | None = None,
    ) -> BlockChain:
        """``hash_blocks`` handing the event loop back between slices, keeping the chain: the
        leading full blocks ``previous`` shares with ``token_ids`` (same tokens, same salt) are
        taken from it, not hashed again."""
        ...

    async def tokenize(self, route: str, body: dict[str, Any]) -> list[int]:
        """Token ids the engine will hash for this request body on this route."""
        ...

    async def touch(self, route: str, body: dict[str, Any]) -> TouchResult:
        """Re-send a recorded request (any proxied route) generating one token."""
        ...

    async def touch_tokens(
        self, token_ids: list[int], *, cache_salt: str | None = None
    ) -> TouchResult:
        """Touch a prefix known only by its token ids."""
        ...

    async def metrics(self) -> EngineMetrics:
        """Scrape the engine's metrics."""
        ...

    async def discover(self, *, cache: bool) -> None:
        """Learn the KV-event endpoint and (``cache``) the cache geometry; failures are raised."""
        ...

    async def discover_scheduling_policy(self) -> str | None:
        """The engine's waiting-queue order (``fcfs``, ``priority``; None: it does not say)."""
        ...

    @property
    def has_events(self) -> bool:
        """Whether a KV-event endpoint is known."""
        ...

    def subscribe(self, sink: EventSink) -> EventSubscription:
        """A started KV-event subscription feeding ``sink``."""
        ...


def forward_headers(headers: Mapping[str, str], hop_by_hop: frozenset[str]) -> dict[str, str]:
    """Headers minus hop-by-hop ones, for either direction of a proxied request."""
    return {k: v for k, v in headers.items() if k.lower() not in hop_by_hop}


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
