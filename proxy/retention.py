"""Retention behind the scenes: protect, expire, evict, offload and prefetch on unmodified engines.

Per engine, one proxy replica (the holder of a Redis lease) drives a tick loop:

1. expire TTLs whose deadline passed (the deadline ZSET is the timer wheel);
2. estimate the engine's LRU horizon: how long a block freed now survives. Two signals, the
   smaller wins: the free queue ahead of a freed block over the block allocation rate (from
   BlockStored events, ``policy.horizon.fill_time_horizon``), and a low quantile of observed
   eviction ages (BlockRemoved of blocks whose last use is known). Without events, resume
   feedback (``cached_tokens`` lower than expected) and a configured touch interval;
3. apply the soft-TTL budget (``policy.budget``): protections beyond the share of the pool lapse,
   least valuable first, reported as ``pressure_override``;
4. touch the protected sessions whose prefix age approaches the horizon (``policy.keepalive``):
   a ``max_tokens: 1`` request over the recorded context, bounded concurrency, one per session.

Every decision is a pure function in ``policy/``; this module gathers inputs and executes.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import struct
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import aiohttp

from adapters.base import AdapterError, EngineMetrics, EngineRejected, TouchResult, Unsupported
from adapters.kv_events import (
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
)
from adapters.lmcache import LMCacheAdapter
from adapters.residency import ResidencyIndex
from adapters.vllm import CHAT_ROUTE, COMPLETION_ROUTE, VLLMAdapter
from policy import (
    BudgetConfig,
    BudgetSession,
    EngineLoad,
    HorizonConfig,
    HorizonEstimator,
    KeepaliveConfig,
    OverheadBudget,
    OverheadConfig,
    ProtectedSession,
    plan_budget,
    plan_touches,
    step_seconds,
    touch_extent,
    window_counts,
)
from policy.anchors import common_prefix
from policy.horizon import RateMeter, fill_time_horizon
from policy.overhead import ANCHOR_TOUCH, SESSION_TOUCH
from proxy.anchors import AnchorKeeper
from proxy.context import RecordedContext, decode_context
from proxy.metrics import Metrics
from proxy.settings import RetentionSettings
from proxy.store import Session, SessionStore, StoreDown, Upserted, Usage
from proxy.tiers import TierKeeper
from proxy.upstream import Engine
from proxy.usage import normalize

log = logging.getLogger("kvkeeper.retention")
_PACK = struct.Struct(">Q")
_VERSION = struct.Struct(">d")  # blocks are stored with the session's last_used stamp


def pack_blocks(blocks: Iterable[int]) -> bytes:
    return b"".join(_PACK.pack(b) for b in blocks)


def unpack_blocks(raw: bytes) -> tuple[int, ...]:
    return tuple(v for (v,) in _PACK.iter_unpack(raw[: len(raw) - len(raw) % 8]))


class HorizonTap:
    """An event sink in front of the residency index that also measures the LRU horizon.

    It counts newly stored GPU blocks (the allocation rate) and, for every removed GPU block,
    how long it sat unused: since the proxy last used it, or since it was stored.
    """

    def __init__(
        self, index: ResidencyIndex, estimator: HorizonEstimator, clock: Any = time.time
    ) -> None:
        self.index = index
        self.estimator = estimator
        self.stores = RateMeter(window_s=5.0, min_span_s=0.25)
        self._clock = clock
        self._stored_total = 0  # GPU blocks stored since start: the allocation front's position
        self._marks: deque[tuple[float, int]] = deque(maxlen=100_000)
        self._stored_at: dict[int, float] = {}
        self.evictions = 0

    def note_used(self, blocks: Iterable[int], at: float) -> None:
        self.index.note_used(blocks, at)

    def apply(self, batch: EventBatch) -> None:
        at = self._clock()
        stored = 0
        ages: list[float] = []
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == GPU:
                stored += len(event.block_hashes)
                self._stored_at.update(dict.fromkeys(event.block_hashes, at))
            elif isinstance(event, BlockRemoved) and event.medium == GPU:
                hashes = event.block_hashes
                # the index still knows the last use: it applies this batch below
                used = self.index.last_used_many(hashes)
                stored_at = map(self._stored_at.pop, hashes, repeat(0.0))
                ages.extend(at - last for last in map(max, used, stored_at) if last > 0)
            elif isinstance(event, AllBlocksCleared):
                self._stored_at.clear()
        if stored:
            self.stores.add(stored, at)
            self._stored_total += stored
            self._marks.append((at, self._stored_total))
        if ages:
            self.evictions += len(ages)
            self.estimator.observe_evictions(ages, at)
        self.index.apply(batch, at)

    def clear(self) -> None:
        self._stored_at.clear()
        self.index.clear()

    def allocated_since(self, at: float) -> int:
        """New GPU blocks stored after ``at``: how far the allocation front moved since then."""
        i = bisect.bisect_right(self._marks, (at, 1 << 62))
        before = self._marks[i - 1][1] if i > 0 else 0
        return self._stored_total - before


@dataclass(eq=False)
class EngineState:
    """Everything the retention layer holds for one engine."""

    engine: Engine
    adapter: VLLMAdapter
    tier: LMCacheAdapter | None
    index: ResidencyIndex = field(default_factory=ResidencyIndex)
    estimator: HorizonEstimator = field(
        default_factory=lambda: HorizonEstimator(HorizonConfig(min_samples=8))
    )
    tap: HorizonTap | None = None
    subscriber: KVEventSubscriber | None = None
    load: EngineLoad | None = None
    leader_token: int = 0
    in_flight: set[tuple[str, str]] = field(default_factory=set)
    overridden: set[tuple[str, str]] = field(default_factory=set)
    # protected, but nothing resident: the session's last_used when that was found
    lost: dict[tuple[str, str], float] = field(default_factory=dict)
    last_scrape: float = 0.0
    last_horizon_s: float = math.inf
    horizon_source: str = "unknown"
    no_tokenize: bool = False
    # what touches and warm-ups may still recompute here (configured by Retention)
    overhead: OverheadBudget = field(default_factory=OverheadBudget)
    # the engine's prefix-cache queries (prompt tokens scheduled, by every client) at the last
    # scrape, and the prompt tokens retention sent since: served traffic earns the credit
    queries_seen: float | None = None
    retention_sent: int = 0
    # prompt tokens the engine computed (not found in its cache or the tier) per second, from
    # its counters: how fast a written-through offload tier takes in new content
    computed_seen: tuple[float, float] | None = None  # (when, cumulative tokens)
    computed_rate: float | None = None
    touch_latency_s: float = 0.05  # running mean of how long touches take to be served
    # the length of the engine's steps (smoothed over scrapes; None until seen), from the
    # buckets of its inter-token and prefill-time histograms at the last scrape
    step_s: float | None = None
    step_seen: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    trimmed_blocks: int = 0  # blocks touches stopped short of (the front would take them first)

    def __post_init__(self) -> None:
        self.tap = HorizonTap(self.index, self.estimator)

    @property
    def mode(self) -> str:
        return "events" if self.subscriber is not None else "feedback"


class _PrefixLost(Exception):
    """A touch found none of the session's prefix left on the engine."""


class _TouchLate(Exception):
    """A touch the engine did not serve within its deadline (abandoned)."""


class _LearnFailed(Exception):
    """The engine did not tokenize a session's context (busy, down, a bad answer): transient."""


# how often each proxy replica drops the cached block ids of sessions that are gone
PRUNE_EVERY_S = 30.0
# how long after a failed tokenize a session's block ids are asked for again
LEARN_RETRY_S = 2.0


def _key(tenant: str, sid: str) -> str:
    return f"{tenant}\x1f{sid}"


class Retention:
    """The retention layer: hooks for the request path, the per-engine workers, and the edits."""

    def __init__(
        self,
        store: SessionStore,
        engines: list[EngineState],
        settings: RetentionSettings,
        metrics: Metrics,
        client: aiohttp.ClientSession,
    ) -> None:
        self.store = store
        self.engines = {e.engine.name: e for e in engines}
        self.settings = settings
        for es in engines:
            es.overhead = OverheadBudget(
                OverheadConfig(
                    share=settings.max_overhead_share,
                    burst_tokens=float(settings.overhead_burst_tokens),
                )
            )
        self.metrics = metrics
        self.client = client
        self.holder = uuid.uuid4().hex[:12]
        self._blocks: dict[tuple[str, str], tuple[float, tuple[int, ...]]] = {}
        # sessions whose block ids the engine failed to give: when to ask again (monotonic)
        self._learn_retry: dict[tuple[str, str], float] = {}
        self._pruned_at = time.time()
        self._tasks: list[asyncio.Task[None]] = []
        self._touches: set[asyncio.Task[int]] = set()
        self._tokenize = asyncio.Semaphore(8)
        self._stopping = asyncio.Event()
        self.anchors = (
            AnchorKeeper(settings, metrics, self._track, self._touch_in_time)
            if settings.anchors or (settings.tier_pin_anchors and settings.tier_pin_share > 0)
            else None
        )
        self.tiers = TierKeeper(store, settings, metrics)

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        for es in self.engines.values():
            await self._connect(es)
            self._tasks.append(
                asyncio.create_task(self._run(es), name=f"retention {es.engine.name}")
            )

    async def stop(self) -> None:
        # A stop flag as well as cancel(): a cancellation swallowed deep inside a client library
        # must not leave a worker running (or stop() waiting for it) forever.
        self._stopping.set()
        tasks = [*self._tasks, *self._touches]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for es in self.engines.values():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self.tiers.release(es)
            if es.subscriber is not None:
                await es.subscriber.aclose()
            with contextlib.suppress(StoreDown):
                await self.store.release_lease(f"engine:{es.engine.name}", self.holder)

    async def _connect(self, es: EngineState) -> None:
        """Learn the engine's cache geometry and event endpoint; subscribe when it publishes."""
        with contextlib.suppress(
            AdapterError, aiohttp.ClientError, TimeoutError, ValueError, KeyError
        ):
            if self.settings.block_size is None:
                await es.adapter.discover_cache_config()
        with contextlib.suppress(
            AdapterError, aiohttp.ClientError, TimeoutError, ValueError, KeyError
        ):
            await es.adapter.discover_events()
        if es.adapter.events is not None and es.subscriber is None:
            assert es.tap is not None
            es.subscriber = es.adapter.subscribe(es.tap)
        log.info(
            "retention on %s: %s mode, block size %d",
            es.engine.name,
            es.mode,
            es.adapter.cache.block_size,
        )

    # --- request path hooks -------------------------------------------------------------------
    def served(self, engine: str, prompt_tokens: int) -> None:
        """A client's request on ``engine`` was served through this proxy: it earns retention
        its share, unless the engine's own counter says what all clients were served (it also
        counts the traffic other kvkeeper replicas and direct clients sent, see ``_earn``)."""
        es = self.engines.get(engine)
        if es is not None and es.queries_seen is None:
            es.overhead.earn(prompt_tokens)

    @staticmethod
    def _earn(es: EngineState, queries: float | None) -> None:
        """Credit from the engine's ``prefix_cache_queries`` counter (prompt tokens it scheduled,
        whoever sent them) less the prompt tokens retention itself sent since the last reading.
        A counter that went back (the engine restarted) counts from zero."""
        if queries is None:
            return
        if es.queries_seen is None:
            es.queries_seen, es.retention_sent = queries, 0
            return
        delta = queries - es.queries_seen if queries >= es.queries_seen else queries
        # retention counts a touch when it sends it, the engine when it schedules it, which can
        # fall in the next reading: what retention sent beyond this reading's growth is carried
        # over, never forgiven (on the swarm, touches re-send about as many prompt tokens as
        # the clients send, so forgiving them would let retention earn from its own touches)
        earned = delta - es.retention_sent
        es.overhead.earn(int(max(0.0, earned)))
        es.queries_seen, es.retention_sent = queries, int(max(0.0, -earned))

    def on_completion(self, engine: str, usage: Usage | None, before: Upserted) -> None:
        """After a hinted request: feed the horizon in feedback mode (blocks are learned lazily).

        A resumed session whose prompt extends its previous one would hit all of that prompt's
        full blocks if they were still resident; fewer cached tokens after a gap bound the LRU
        horizon below that gap.
        """
        es = self.engines.get(engine)
        if es is None or es.mode != "feedback" or usage is None or not before.last_active:
            return
        now = time.time()
        bs = es.adapter.cache.block_size
        expected = min(before.last_prompt_tokens, usage.prompt_tokens - 1) // bs * bs
        if expected > 0:
            es.estimator.observe_resume(
                now - before.last_active, usage.cached_tokens, expected, now
            )

    async def _block_ids(self, es: EngineState, ctx: RecordedContext) -> tuple[int, ...] | None:
        if ctx.route not in (CHAT_ROUTE, COMPLETION_ROUTE):
            return None
        if es.no_tokenize:
            return None
        try:
            async with self._tokenize:
                tokens = await es.adapter.tokenize(ctx.route, ctx.body)
        except EngineRejected as exc:
            if exc.status in (404, 405):  # no /tokenize on this engine: stop asking
                es.no_tokenize = True
                log.warning("%s serves no /tokenize: block ids unknown", es.engine.name)
                return None
            raise _LearnFailed(str(exc)) from exc
        except (AdapterError, KeyError, ValueError, TypeError) as exc:
            raise _LearnFailed(str(exc)) from exc
        offset = ctx.block_offset
        ids = es.adapter.hasher.block_ids(tokens, cache_salt=ctx.body.get("cache_salt"))
        return tuple(ids[:offset] if offset is not None else ids)

    async def blocks_of(
        self, tenant: str, sid: str, session: Session | None = None, *, active_s: float = 0.0
    ) -> tuple[int, ...]:
        """The block ids of the session's recorded context, recomputed only when it changed.

        Learned lazily (here, not on the request path): tokenizing costs an engine round trip,
        and only protected sessions and edits need the ids. The version is the session's
        ``last_used`` stamp, so every proxy replica sees when another one recorded a new context.
        A session used within the last ``active_s`` seconds keeps the ids learned before: it
        needs no touch while it runs, and is re-learned once when it pauses.
        """
        if session is None:
            session = await self.store.get(tenant, sid)
            if session is None:
                return ()
        version = session.last_used
        cached = self._blocks.get((tenant, sid))
        if cached is not None and (
            cached[0] == version or time.time() - session.last_used < active_s
        ):
            return cached[1]
        es = self.engines.get(session.engine or "")
        if es is not None and es.no_tokenize:  # nobody can learn them: skip the reads
            return cached[1] if cached is not None else ()
        if time.monotonic() < self._learn_retry.get((tenant, sid), -math.inf):
            return cached[1] if cached is not None else ()
        raw = await self.store.get_blocks(tenant, sid)
        if raw is not None and len(raw) >= 8 and _VERSION.unpack(raw[:8])[0] == version:
            blocks = unpack_blocks(raw[8:])
        else:
            try:
                blocks = await self._learn_blocks(session) or ()
            except _LearnFailed as exc:  # the engine did not answer: ask again, not every tick
                log.debug("block ids of %s not learned yet: %s", sid, exc)
                self._learn_retry[(tenant, sid)] = time.monotonic() + LEARN_RETRY_S
                return cached[1] if cached is not None else ()
        self._learn_retry.pop((tenant, sid), None)
        self._blocks[(tenant, sid)] = (version, blocks)
        return blocks

    async def _learn_blocks(self, session: Session) -> tuple[int, ...] | None:
        es = self.engines.get(session.engine or "")
        blob = await self.store.get_context(session.tenant, session.session_id)
        if es is None or blob is None:
            return None
        blocks = await self._block_ids(es, decode_context(blob))
        if blocks is None:
            return None
        assert es.tap is not None
        es.tap.note_used(blocks, session.last_used or time.time())
        payload = _VERSION.pack(session.last_used) + pack_blocks(blocks)
        with contextlib.suppress(StoreDown):
            await self.store.set_blocks(session.tenant, session.session_id, payload)
        return blocks

    def pool_tokens(self, engine: str) -> int | None:
        """Tokens the engine's KV cache holds, once its metrics told its pool size."""
        es = self.engines.get(engine)
        if es is None or es.load is None:
            return None
        return es.load.pool_blocks * es.adapter.cache.block_size

    def known_blocks(self, tenant: str, sid: str) -> tuple[int, ...]:
        """The session's block ids as last learned here (no I/O: for routing decisions)."""
        cached = self._blocks.get((tenant, sid))
        return cached[1] if cached is not None else ()

    def shared_prefix(self, tenant: str, sid: str, blocks: tuple[int, ...]) -> int:
        """Leading blocks of ``blocks`` that another session learned here also starts with
        (any tenant: block ids chain over the content and its cache salt). Sessions that ended
        may still be counted, which only keeps more."""
        if not blocks:
            return 0
        return max(
            (
                common_prefix(blocks, theirs)
                for key, (_, theirs) in self._blocks.items()
                if key != (tenant, sid) and theirs and theirs[0] == blocks[0]
            ),
            default=0,
        )

    def forget(self, tenant: str, sid: str) -> None:
        self._blocks.pop((tenant, sid), None)
        self._learn_retry.pop((tenant, sid), None)
        if self.anchors is not None:
            self.anchors.forget(tenant, sid)

    async def prune(self, now: float) -> int:
        """Forget the sessions the store no longer has (idle expiry, a free by an edit or by
        another replica), at most every ``PRUNE_EVERY_S``; how many were forgotten. Without it
        the block ids of every session ever learned here stay in memory, and ``shared_prefix``
        scans them all."""
        if now - self._pruned_at < PRUNE_EVERY_S:
            return 0
        self._pruned_at = now
        keys, gone = list(self._blocks), 0
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            for key, alive in zip(chunk, await self.store.exist(chunk), strict=True):
                if not alive:
                    self.forget(*key)
                    gone += 1
        return gone

    # --- the worker -----------------------------------------------------------------------------
    async def _run(self, es: EngineState) -> None:
        lease = f"engine:{es.engine.name}"
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        while not self._stopping.is_set():
            try:
                token = await self.store.lease(lease, self.holder, ttl_ms)
                if token and token != es.leader_token:
                    log.info(
                        "retention: %s now drives %s (fence %d)", self.holder, es.engine.name, token
                    )
                    await self.tiers.adopt(es)
                elif not token and es.leader_token:
                    self.tiers.abandon(es)
                es.leader_token = token
                if token:
                    started = time.perf_counter()
                    await self.tick(es, time.time())
                    self.metrics.child(self.metrics.retention_tick, es.engine.name).observe(
                        time.perf_counter() - started
                    )
                await self.prune(time.time())  # this replica's own cache: leader or not
            except StoreDown:  # the lease may pass to another replica meanwhile
                if es.leader_token:
                    self.tiers.abandon(es)
                es.leader_token = 0
            except Exception:  # a bad tick must not end the worker
                log.exception("retention tick failed on %s", es.engine.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.settings.tick_s)

    async def tick(self, es: EngineState, now: float) -> None:
        await self._expire(now)
        await self._scrape(es, now)
        horizon = self._horizon(es, now)
        if self.anchors is not None:
            await self.anchors.tick(es, now, horizon)
        # a session that has not finished a request yet has no recorded context to touch
        sessions = [
            s for s in await self.store.protected(now) if s.last_used > 0 and self._drives(es, s)
        ]
        blocks: dict[tuple[str, str], tuple[int, ...]] = {}
        for i, s in enumerate(sessions):
            if i % 128 == 127:
                await asyncio.sleep(0)  # a long list must not hold the data plane's loop
            blocks[(s.tenant, s.session_id)] = await self.blocks_of(
                s.tenant, s.session_id, s, active_s=self.settings.relearn_idle_s
            )
        # sessions the offload tier holds resume by a load, not a re-prefill: no touches (and
        # the pins of sessions no longer protected are released, so this runs with none too)
        anchors = (
            self.anchors.pin_candidates(es.engine.name, now)
            if self.anchors is not None and self.settings.tier_pin_anchors
            else []
        )
        held = await self.tiers.tick(es, sessions, blocks, now, anchors)
        held |= await self.tiers.covered(es, sessions, now)
        sessions = [s for s in sessions if (s.tenant, s.session_id) not in held]
        if not sessions:
            return
        kept = self._budget(es, sessions, blocks, now)
        plan = plan_touches(
            [
                ProtectedSession(
                    session_id=_key(s.tenant, s.session_id),
                    last_active_at=s.last_active,
                    ttl_until=s.ttl_until,
                    n_blocks=len(blocks[(s.tenant, s.session_id)]),
                    touch_in_flight=(s.tenant, s.session_id) in es.in_flight,
                    value=float(max(1, len(blocks[(s.tenant, s.session_id)]))),
                )
                for s in sessions
                if (s.tenant, s.session_id) in kept
            ],
            horizon,
            now,
            KeepaliveConfig(
                safety_fraction=self.settings.safety_fraction,
                max_concurrent_touches=self.settings.max_concurrent_touches,
                unknown_horizon_interval_s=self.settings.fallback_touch_interval_s,
            ),
        )
        by_key = {_key(s.tenant, s.session_id): s for s in sessions}
        chosen = set(plan.touch) | self._urgent(es, sessions, kept, now)
        for key in chosen:
            session = by_key[key]
            sk = (session.tenant, session.session_id)
            if es.lost.get(sk) == session.last_used:
                continue  # found evicted, and nothing new recorded since
            current = self._blocks.get(sk, (None, ()))[0] == session.last_used
            if current and self._resident(es, blocks[sk]) == 0:
                self._mark_lost(es, session)
                continue
            reserved = es.overhead.admit_touch()
            if reserved is None:
                self.metrics.touches.labels(es.engine.name, "over_budget").inc()
                continue
            self._spawn_touch(es, session, reserved)
        if es.lost:  # forget the losses of sessions no longer protected here
            es.lost = {sk: v for sk, v in es.lost.items() if _key(*sk) in by_key}
        self.metrics.overhead_credit.labels(es.engine.name).set(es.overhead.credit)

    def _mark_lost(self, es: EngineState, session: Session) -> None:
        """The engine already evicted the session's prefix: a touch would be a full re-prefill
        nobody asked for, competing with live traffic (the resume pays it if it comes). Counted
        once per loss: until the session records a new context, it is not touched again."""
        sk = (session.tenant, session.session_id)
        if es.lost.get(sk) != session.last_used:
            es.lost[sk] = session.last_used
            self.metrics.touches.labels(es.engine.name, "skipped_lost").inc()

    def _resident(self, es: EngineState, blocks: tuple[int, ...]) -> int | None:
        """With KV events: how many leading blocks of ``blocks`` the engine still holds (None:
        no events or no ids)."""
        if es.subscriber is None or not blocks:
            return None
        return es.index.resident_prefix(blocks)

    def _urgent(
        self, es: EngineState, sessions: list[Session], kept: set[tuple[str, str]], now: float
    ) -> set[str]:
        """Sessions the allocation front has moved far past, whatever the time-based plan says.

        Counted in blocks, not seconds: a burst allocates blocks faster than any rate estimate
        can follow, and ``safety_fraction`` of the free queue is the share a prefix may fall back.
        """
        if es.load is None or es.tap is None or es.subscriber is None:
            return set()
        free = es.load.free_blocks
        limit = self.settings.safety_fraction * free
        return {
            _key(s.tenant, s.session_id)
            for s in sessions
            if (s.tenant, s.session_id) in kept
            and (s.tenant, s.session_id) not in es.in_flight
            and es.tap.allocated_since(s.last_active) >= limit
        }

    def _drives(self, es: EngineState, session: Session) -> bool:
        if session.engine is not None:
            return session.engine == es.engine.name
        return es is next(iter(self.engines.values()))  # not yet routed: the first engine

    async def _expire(self, now: float) -> None:
        for tenant, sid in await self.store.due(now):
            if await self.store.expire(tenant, sid, now):
                self.metrics.expiries.inc()

    async def _scrape(self, es: EngineState, now: float, max_age_s: float = 2.0) -> None:
        """Refresh ``es.load`` from the engine's /metrics when it is older than ``max_age_s``."""
        if now - es.last_scrape < max_age_s:
            return
        es.last_scrape = now
        try:
            m = await es.adapter.metrics()
        except AdapterError:
            return
        self._earn(es, m.prefix_cache_queries)
        self._computed(es, m, now)
        self._steps(es, m)
        pool = (
            m.cache_config.num_blocks if m.cache_config else None
        ) or es.adapter.cache.num_blocks
        if pool:
            es.load = EngineLoad(
                pool_blocks=pool,
                kv_cache_usage=m.kv_cache_usage,
                waiting=m.waiting,
                running=m.running,
            )

    @staticmethod
    def _computed(es: EngineState, m: EngineMetrics, now: float) -> None:
        """Update ``es.computed_rate`` (smoothed over scrapes) from the engine's counters."""
        if m.prefix_cache_queries is None or m.prefix_cache_hits is None:
            return
        total = m.prefix_cache_queries - m.prefix_cache_hits - (m.external_prefix_cache_hits or 0)
        seen = es.computed_seen
        if seen is not None and now > seen[0] and total >= seen[1]:
            rate = (total - seen[1]) / (now - seen[0])
            prev = es.computed_rate
            es.computed_rate = rate if prev is None else 0.5 * prev + 0.5 * rate
        es.computed_seen = (now, total)

    @staticmethod
    def _steps(es: EngineState, m: EngineMetrics) -> None:
        """Update ``es.step_s`` from the latencies the engine observed since the last scrape
        (:mod:`policy.steps`): the time between output tokens where requests decoded, else
        (one-token requests only) the time from scheduling to first token."""
        step: float | None = None
        for name, hist in (("inter_token", m.inter_token), ("prefill", m.prefill_time)):
            if hist is None:
                continue
            seen = es.step_seen.get(name)
            es.step_seen[name] = hist.buckets
            if step is None and seen is not None:
                step = step_seconds(window_counts(seen, hist.buckets))
        if step is not None:
            es.step_s = step if es.step_s is None else 0.5 * es.step_s + 0.5 * step

    def touch_deadline(self, es: EngineState) -> float:
        """How long a keep-alive touch may take before it is abandoned: ``touch_deadline_s``,
        or ``touch_deadline_steps`` of the engine's steps where those are longer. A touch that
        arrives during a step waits for it and is served in the next, so on an engine whose
        steps take seconds (a CPU engine prefilling a long prompt) a fixed second would abandon
        touches that are only waiting their turn."""
        floor = self.settings.touch_deadline_s
        if es.step_s is None:
            return floor
        return max(floor, self.settings.touch_deadline_steps * es.step_s)

    async def fresh_load(self, es: EngineState, max_age_s: float = 0.5) -> EngineLoad | None:
        """The engine's load, scraped again when the last reading is older than ``max_age_s``."""
        await self._scrape(es, time.time(), max_age_s)
        return es.load

    def _horizon(self, es: EngineState, now: float) -> float:
        """The smaller of the fill-time and eviction-age estimates (inf = unknown)."""
        assert es.tap is not None
        candidates: list[tuple[float, str]] = []
        est = es.estimator.estimate(now)
        if est.known:
            candidates.append((est.seconds, est.source.value))
        if es.load is not None and es.subscriber is not None:
            free = es.load.free_blocks
            fill = fill_time_horizon(free, es.tap.stores.rate(now))
            if math.isfinite(fill):
                candidates.append((fill, "fill_rate"))
        es.last_horizon_s, es.horizon_source = min(candidates, default=(math.inf, "unknown"))
        self.metrics.child(self.metrics.horizon, es.engine.name).set(es.last_horizon_s)
        return es.last_horizon_s

    def _budget(
        self,
        es: EngineState,
        sessions: list[Session],
        blocks: dict[tuple[str, str], tuple[int, ...]],
        now: float,
    ) -> set[tuple[str, str]]:
        """Sessions whose protection fits the soft-TTL budget; the rest lapse (pressure_override)."""
        everyone = {(s.tenant, s.session_id) for s in sessions}
        if es.load is None:
            return everyone
        decision = plan_budget(
            [
                BudgetSession(
                    _key(s.tenant, s.session_id),
                    blocks[(s.tenant, s.session_id)],
                    _value(s, blocks, now),
                )
                for s in sessions
            ],
            es.load,
            BudgetConfig(share=self.settings.budget_share),
        )
        lapsed = {tuple(k.split("\x1f", 1)) for k in decision.pressure_override}
        overridden = {(t, s) for t, s in lapsed}
        for key in overridden - es.overridden:
            self.metrics.pressure_overrides.inc()
            log.info(
                "pressure_override: %s/%s protection lapses on %s", key[0], key[1], es.engine.name
            )
        es.overridden = overridden
        self.metrics.protected_sessions.labels(es.engine.name).set(len(everyone - overridden))
        self.metrics.protected_blocks.labels(es.engine.name).set(decision.protected_blocks)
        return everyone - overridden

    # --- touches and warm-ups ---------------------------------------------------------------------
    def _spawn_touch(self, es: EngineState, session: Session, reserved: float) -> None:
        key = (session.tenant, session.session_id)
        es.in_flight.add(key)
        self._track(es, self._touch(es, session), reserved, lambda: es.in_flight.discard(key))

    def _track(
        self,
        es: EngineState,
        touch: Coroutine[Any, Any, int],
        reserved: float,
        on_done: Callable[[], None],
        kind: str = SESSION_TOUCH,
    ) -> None:
        """Run a touch (returning the prompt tokens it recomputed) as a task that ``stop``
        cancels; when it ends, settle the overhead credit ``reserved`` for it with what it
        recomputed (``kind``: whose estimate it updates), then ``on_done``."""
        task = asyncio.create_task(touch)
        self._touches.add(task)

        def done(t: asyncio.Task[int]) -> None:
            self._touches.discard(t)
            recomputed = 0
            if not t.cancelled():
                if (exc := t.exception()) is not None:
                    log.error("touch on %s failed", es.engine.name, exc_info=exc)
                else:
                    recomputed = t.result()
            es.overhead.settle(reserved, recomputed, touch=True, kind=kind)
            on_done()

        task.add_done_callback(done)

    async def _touch(
        self, es: EngineState, session: Session, limit_blocks: int | None = None
    ) -> int:
        """Refresh the session's prefix; the prompt tokens it recomputed (0: it did not run).
        Only its still-resident leading blocks are re-sent (found from the recorded context
        itself, so ids learned before the context last changed cannot mislead it): the evicted
        tail would be a re-prefill the resume pays anyway if it comes, so a touch recomputes
        one token whatever LRU already took."""
        try:
            result = await self.replay(
                es,
                session.tenant,
                session.session_id,
                warmup=False,
                limit_blocks=limit_blocks,
                resident_only=True,
            )
        except _PrefixLost:
            self._mark_lost(es, session)
            return 0
        except _TouchLate:
            es.touch_latency_s += 0.2 * (self.touch_deadline(es) - es.touch_latency_s)
            self.metrics.touches.labels(es.engine.name, "late").inc()
            return 0
        except (AdapterError, StoreDown, ValueError) as exc:
            self.metrics.touches.labels(es.engine.name, "failed").inc()
            log.warning("touch of %s failed: %s", session.session_id, exc)
            return 0
        if result is None:
            self.metrics.touches.labels(es.engine.name, "no_context").inc()
            return 0
        return result.recomputed_tokens

    async def replay(
        self,
        es: EngineState,
        tenant: str,
        sid: str,
        *,
        warmup: bool,
        limit_blocks: int | None = None,
        resident_only: bool = False,
    ) -> TouchResult | None:
        """Re-send the session's recorded prefix with one output token; record what it cost.

        ``limit_blocks`` caps the prefix at that many blocks; ``resident_only`` (with KV events)
        at the blocks the engine still holds, raising :class:`_PrefixLost` when it holds none.
        """
        blob = await self.store.get_context(tenant, sid)
        if blob is None:
            return None
        ctx = decode_context(blob)
        limits = [n for n in (ctx.block_offset, limit_blocks) if n is not None]
        offset = min(limits) if limits else None
        exact = resident_only and es.subscriber is not None and not es.no_tokenize
        if (offset is not None or exact) and ctx.route in (CHAT_ROUTE, COMPLETION_ROUTE):
            salt = ctx.body.get("cache_salt")
            tokens = await es.adapter.tokenize(ctx.route, ctx.body)
            if exact:
                ids = es.adapter.hasher.block_ids(tokens, cache_salt=salt)
                resident = es.index.resident_prefix(ids)
                if not warmup:  # stop short of what LRU takes before the touch is served
                    assert es.tap is not None
                    rate = es.tap.stores.rate(time.time())
                    extent = touch_extent(len(ids), resident, rate, es.touch_latency_s)
                    es.trimmed_blocks += resident - extent
                    resident = extent
                offset = resident if offset is None else min(offset, resident)
                if offset == 0:
                    raise _PrefixLost
            assert offset is not None
            # one token past the last whole block: vLLM looks up at most num_tokens - 1 tokens,
            # so a prompt of exactly N blocks would recompute (and not refresh) the N-th; this
            # one hits all N and recomputes a single token
            tokens = tokens[: max(1, offset) * es.adapter.cache.block_size + 1]
            es.retention_sent += len(tokens)  # counted when sent, not earned (see _earn)
            result = await self._in_time(
                es, es.adapter.touch_tokens(tokens, cache_salt=salt), warmup=warmup
            )
        elif ctx.route in (CHAT_ROUTE, COMPLETION_ROUTE):
            result = await self._in_time(
                es, es.adapter.touch(ctx.route, ctx.prefix_body()), warmup=warmup
            )
            es.retention_sent += result.prompt_tokens  # (its length known only now)
        else:
            result = await self._touch_other(es, ctx)
            es.retention_sent += result.prompt_tokens
        now = time.time()
        assert es.tap is not None
        es.tap.note_used(await self.blocks_of(tenant, sid), now)
        recomputed = result.recomputed_tokens
        # the session's counters first: with no await after it, a touch is either counted in
        # both places or (cancelled before) in neither
        await self.store.touched(tenant, sid, now, recomputed, warmup=warmup)
        if warmup:
            self.metrics.warmup_prompt_tokens.inc(result.prompt_tokens)
            self.metrics.warmup_recomputed_tokens.inc(recomputed)
        else:
            es.touch_latency_s += 0.2 * (result.seconds - es.touch_latency_s)
            self.metrics.touches.labels(es.engine.name, "ok").inc()
            self.metrics.touch_prompt_tokens.inc(result.prompt_tokens)
            self.metrics.touch_recomputed_tokens.inc(recomputed)
        return result

    async def _in_time(
        self, es: EngineState, touch: Awaitable[TouchResult], *, warmup: bool
    ) -> TouchResult:
        """A keep-alive touch that the engine has not served within its deadline is
        waiting in its queue, where it holds nothing: by the time it is scheduled LRU may have
        taken the prefix, and the touch would re-prefill it in the middle of the congestion.
        It is abandoned instead (the engine aborts a request whose client left). Warm-ups are
        asked for and always run to the end."""
        if warmup:
            return await touch
        try:
            async with asyncio.timeout(self.touch_deadline(es)):
                return await touch
        except TimeoutError:
            raise _TouchLate from None

    async def _touch_in_time(
        self, es: EngineState, touch: Awaitable[TouchResult]
    ) -> TouchResult | None:
        """A keep-alive touch under the deadline; None when it was abandoned."""
        try:
            return await self._in_time(es, touch, warmup=False)
        except _TouchLate:
            return None

    async def _touch_other(self, es: EngineState, ctx: RecordedContext) -> TouchResult:
        """Anthropic /v1/messages and /v1/responses: the same one-token request on their route."""
        body = ctx.prefix_body()
        for k in ("stream", "stream_options"):
            body.pop(k, None)
        body["max_output_tokens" if ctx.route == "/v1/responses" else "max_tokens"] = 1
        started = time.monotonic()
        try:
            async with self.client.post(es.engine.url + ctx.route, json=body) as resp:
                answer = await resp.json(content_type=None)
                if resp.status >= 400:
                    raise Unsupported(f"{ctx.route} touch answered {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unsupported(f"{ctx.route} touch failed: {exc}") from exc
        usage = normalize(answer.get("usage") if isinstance(answer, dict) else None) or Usage()
        return TouchResult(usage.prompt_tokens, usage.cached_tokens, time.monotonic() - started)

    # --- views ------------------------------------------------------------------------------------
    def engine_view(self, name: str, tenant: str | None = None) -> dict[str, Any]:
        """What retention holds on one engine; ``tenant``: only that tenant's anchors."""
        es = self.engines.get(name)
        if es is None:
            return {}
        return {
            "mode": es.mode,
            "mode_note": (
                "KV events: horizon from allocation rate and eviction ages"
                if es.mode == "events"
                else "no KV events: horizon from cached_tokens feedback, touches every "
                f"{self.settings.fallback_touch_interval_s:g}s until learned"
            ),
            "leader": bool(es.leader_token),
            "horizon_s": None if math.isinf(es.last_horizon_s) else round(es.last_horizon_s, 3),
            "horizon_source": es.horizon_source,
            "block_size": es.adapter.cache.block_size,
            "pool_blocks": es.load.pool_blocks if es.load else None,
            "resident_blocks": {m: es.index.size(m) for m in es.index.media()},
            "offload_tier": es.tier is not None,
            "tier_pinned": self.tiers.pinned(name) if es.tier is not None else None,
            "touches_in_flight": len(es.in_flight),
            "touch_latency_s": round(es.touch_latency_s, 4),
            "step_s": None if es.step_s is None else round(es.step_s, 4),
            "touch_deadline_s": round(self.touch_deadline(es), 3),
            "touch_trimmed_blocks": es.trimmed_blocks,
            "overhead": {
                "max_share": es.overhead.config.share,
                # what earns the credit: the engine's query counter (every client's traffic) or,
                # until it has been read, the traffic this proxy forwarded
                "earned_from": "engine" if es.queries_seen is not None else "proxy",
                "credit_tokens": round(es.overhead.credit, 1),
                "touch_estimate_tokens": round(es.overhead.touch_estimate, 1),
                "anchor_touch_estimate_tokens": round(es.overhead.estimate(ANCHOR_TOUCH), 1),
                "recomputed_tokens": int(es.overhead.spent),
                "declined": es.overhead.declined,
            },
            "pressure_overrides_now": len(es.overridden),
            "anchors": (
                self.anchors.view(name, time.time(), tenant) if self.anchors is not None else []
            ),
        }

    async def residency(self, session: Session) -> dict[str, Any]:
        blocks = await self.blocks_of(session.tenant, session.session_id, session)
        out: dict[str, Any] = {"blocks": len(blocks), "engines": {}}
        for name, es in self.engines.items():
            view: dict[str, Any] = es.index.prefix_by_medium(blocks) if blocks else {}
            out["engines"][name] = {"resident_prefix_blocks": view}
        return out


def _value(session: Session, blocks: dict[tuple[str, str], tuple[int, ...]], now: float) -> float:
    """Budget value: recompute cost (blocks) per second of protection still to pay for."""
    n = len(blocks[(session.tenant, session.session_id)])
    return max(1, n) / max(1.0, session.ttl_left(now))
