"""An in-memory engine adapter: the second ``EngineAdapter``, for unit tests without I/O.

Like httpx's MockTransport it stands in for the engine at the seam proxy/ is typed against:
a prefix cache of ``num_blocks`` blocks evicted by LRU, KV events delivered synchronously to
the subscribed sink, touches answered with the cached tokens they found, and metrics counters.
Registered as engine kind ``"memory"``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from adapters.base import (
    BlockChain,
    CacheConfig,
    EngineAdapter,
    EngineMetrics,
    EventSink,
    TouchResult,
)
from adapters.kv_events import BlockRemoved, BlockStored, EventBatch
from adapters.registry import AdapterSpec, register

_U64 = (1 << 64) - 1  # block ids are unsigned 64-bit, as the engine's events carry them


@dataclass
class _Subscription:
    engine: MemoryEngine
    sink: EventSink
    token_ids: bool = False

    async def aclose(self) -> None:
        self.engine.subscription = None


@dataclass
class MemoryEngine:
    """An engine that lives in this process (see the module docstring)."""

    name: str = "mem"
    base_url: str = "http://memory:1"
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(block_size=4, num_blocks=64))
    events: bool = True
    priority_header: str | None = "X-Memory-Priority"
    priority_field: str = "priority"
    hop_by_hop: frozenset[str] = frozenset({"connection", "host", "content-length"})
    health_routes: tuple[str, ...] = ("/health",)
    prioritized: bool = False
    scheduling_policy: str | None = None
    subscription: _Subscription | None = None
    waiting: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    touches: list[list[int]] = field(default_factory=list)  # token ids of every touch
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # resident, oldest first
    latency_s: float = 0.0

    # --- the seam -------------------------------------------------------------------------
    def tokenizable(self, route: str) -> bool:
        return route in ("/v1/completions", "/v1/chat/completions")

    def hash_blocks(self, token_ids: Sequence[int], *, cache_salt: Any = None) -> list[int]:
        bs, out, parent = self.cache.block_size, [], hash(("root", cache_salt))
        for i in range(len(token_ids) // bs):
            parent = hash((parent, tuple(token_ids[i * bs : (i + 1) * bs]))) & _U64
            out.append(parent)
        return out

    async def hash_chain_async(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: Any = None,
        previous: BlockChain | None = None,
    ) -> BlockChain:
        ids = self.hash_blocks(token_ids, cache_salt=cache_salt)  # (its links are its ids)
        return BlockChain(token_ids, cache_salt, ids, ids)

    async def tokenize(self, route: str, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if isinstance(prompt, str):
            return list(prompt.encode())
        return list(repr(body.get("messages")).encode())

    async def touch(self, route: str, body: dict[str, Any]) -> TouchResult:
        return self.serve(await self.tokenize(route, body), body.get("cache_salt"))

    async def touch_tokens(
        self, token_ids: list[int], *, cache_salt: str | None = None
    ) -> TouchResult:
        self.touches.append(list(token_ids))
        return self.serve(token_ids, cache_salt)

    async def metrics(self) -> EngineMetrics:
        pool = self.cache.num_blocks or 1
        return EngineMetrics(
            kv_cache_usage=len(self.lru) / pool,
            running=0.0,
            waiting=self.waiting,
            prefix_cache_queries=self.queries,
            prefix_cache_hits=self.hits,
            cache_config=self.cache,
        )

    async def discover(self, *, cache: bool) -> None:
        return None

    async def discover_scheduling_policy(self) -> str | None:
        return self.scheduling_policy

    @property
    def has_events(self) -> bool:
        return self.events

    def subscribe(self, sink: EventSink) -> _Subscription:
        self.subscription = _Subscription(self, sink)
        return self.subscription

    def _publish(self, *events: Any) -> None:
        if self.subscription is not None:
            self.subscription.sink.apply(EventBatch(time.time(), tuple(events)))

    # --- the engine ---------------------------------------------------------------------------
    def serve(self, tokens: Sequence[int], cache_salt: Any = None) -> TouchResult:
        """Run a one-token request over ``tokens``: hit its resident leading blocks (at most
        prompt - 1 tokens, as vLLM looks up), store the rest, evict by LRU."""
        started = time.monotonic()
        bs = self.cache.block_size
        ids = self.hash_blocks(tokens, cache_salt=cache_salt)
        hit = 0
        for h in ids:
            if h not in self.lru:
                break
            hit += 1
        cached = min(hit * bs, max(0, len(tokens) - 1))
        stored = [h for h in ids if h not in self.lru]
        for h in ids:
            self.lru[h] = None
            self.lru.move_to_end(h)
        removed = []
        while len(self.lru) > (self.cache.num_blocks or 1):
            removed.append(self.lru.popitem(last=False)[0])
        self.queries += len(tokens)
        self.hits += cached
        events: list[Any] = []
        if stored:
            events.append(BlockStored(tuple(stored), None, (), bs))
        if removed:
            events.append(BlockRemoved(tuple(removed)))
        if events:
            self._publish(*events)
        return TouchResult(len(tokens), cached, self.latency_s or time.monotonic() - started)

    def evict_all(self) -> None:
        removed = tuple(self.lru)
        self.lru.clear()
        if removed:
            self._publish(BlockRemoved(removed))


def _factory(spec: AdapterSpec, session: aiohttp.ClientSession) -> EngineAdapter:
    return MemoryEngine(name=spec.name, base_url=spec.url)


register("memory", _factory)
