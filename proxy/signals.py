"""Per-engine signals: load, residency, the LRU horizon and the retention overhead credit.

One ``EngineSignals`` per engine, fed by its /metrics scrapes and its KV events; placement and
retention both read it. Only the process holding the engine's retention lease subscribes to its
KV events; it relays what they change to the other workers and replicas
(``proxy/residency_share.py``), which feed the same index and horizon tap from that.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

import aiohttp

from adapters.base import AdapterError, EngineAdapter, EventSubscription
from adapters.kv_events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from adapters.residency import ResidencyIndex
from policy import EngineLoad, HorizonConfig, HorizonEstimator, OverheadBudget
from policy.horizon import RateMeter, fill_time_horizon

log = logging.getLogger("kvkeeper.signals")

SCRAPE_EVERY_S = 2.0  # /metrics is read at most this often by the retention tick


class HorizonTap:
    """An event sink in front of the residency index that also measures the LRU horizon.

    It counts newly stored GPU blocks (the allocation rate) and, for every removed GPU block,
    how long it sat unused: since the proxy last used it, or since it was stored.
    """

    def __init__(
        self,
        index: ResidencyIndex,
        estimator: HorizonEstimator,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.estimator = estimator
        # what this process's own subscription applies goes to the other processes too
        self.relay: Callable[[EventBatch | None], None] | None = None
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
        if self.relay is not None:
            self.relay(batch)

    def clear(self) -> None:
        self._stored_at.clear()
        self.index.clear()
        if self.relay is not None:
            self.relay(None)

    def allocated_since(self, at: float) -> int:
        """New GPU blocks stored after ``at``: how far the allocation front moved since then."""
        i = bisect.bisect_right(self._marks, (at, 1 << 62))
        before = self._marks[i - 1][1] if i > 0 else 0
        return self._stored_total - before


class EngineSignals:
    """What one engine's metrics and KV events say about it right now."""

    def __init__(self, name: str, adapter: EngineAdapter) -> None:
        self.name = name
        self.adapter = adapter
        self.index = ResidencyIndex()
        self.estimator = HorizonEstimator(HorizonConfig(min_samples=8))
        self.tap = HorizonTap(self.index, self.estimator)
        self.subscription: EventSubscription | None = None  # this process's own, if any
        self.events_on = False  # the engine's KV events feed the index (here or relayed)
        self.relayed_batches = 0  # event batches another process's subscription relayed
        self.on_fallback: Callable[[str], None] | None = None  # tell the others: events off
        self.hashes_match = False  # the hash self-check passed (here or where it subscribes)
        self.on_match: Callable[[str], None] | None = None  # tell the others: hashes match
        # sees each subscription as it starts, before its first batch (the hash self-check)
        self.on_subscribed: Callable[[EventSubscription], None] | None = None
        self.load: EngineLoad | None = None
        self.on_scraped: Callable[[str, EngineLoad], None] | None = None  # a reading to share
        self.overhead = OverheadBudget()  # what touches and warm-ups may still recompute here
        self.last_scrape = 0.0
        self.horizon_s = math.inf
        self.horizon_source = "unknown"
        # the engine's prefix-cache queries (prompt tokens scheduled, by every client) at the
        # last scrape, and the prompt tokens retention sent since: served traffic earns credit
        self.queries_seen: float | None = None
        self.retention_sent = 0

    @property
    def has_events(self) -> bool:
        return self.events_on

    @property
    def subscribed(self) -> bool:
        """Whether this process holds the engine's KV-event subscription."""
        return self.subscription is not None

    @property
    def mode(self) -> str:
        return "events" if self.has_events else "feedback"

    @property
    def block_size(self) -> int:
        return self.adapter.cache.block_size

    async def connect(self, *, discover_cache: bool) -> None:
        """Learn the engine's cache geometry and event endpoint (subscribing is ``subscribe``'s,
        done by the holder of the engine's lease)."""
        with contextlib.suppress(
            AdapterError, aiohttp.ClientError, TimeoutError, ValueError, KeyError
        ):
            await self.adapter.discover(cache=discover_cache)
        self.events_on = self.adapter.has_events
        log.info("retention on %s: %s mode, block size %d", self.name, self.mode, self.block_size)

    def subscribe(self) -> None:
        """This process took the engine's lease: follow its KV events (a late joiner's
        subscriber first replays what the publisher still buffers, the hand-over's gap)."""
        if self.events_on and self.subscription is None:
            self.subscription = self.adapter.subscribe(self.tap)
            if self.on_subscribed is not None:
                self.on_subscribed(self.subscription)
            if self.hashes_match and self.on_match is not None:  # for those joined meanwhile
                self.on_match(self.name)
            log.info("kv events of %s: subscribed", self.name)

    async def unsubscribe(self) -> None:
        """Another process holds the lease now: its relay feeds the index from here on."""
        sub, self.subscription = self.subscription, None
        if sub is not None:
            await sub.aclose()
            log.info("kv events of %s: subscription handed over", self.name)

    async def aclose(self) -> None:
        await self.unsubscribe()

    async def fall_back(self) -> None:
        """Stop trusting the engine's events (their hashes are not ours): feedback mode."""
        self.events_on = False
        await self.unsubscribe()
        self.tap.clear()
        if self.on_fallback is not None:
            self.on_fallback(self.name)

    def relayed(self, batch: EventBatch | None) -> None:
        """Events another process's subscription relayed (None: the cache was cleared); its
        own subscription, if this process has one meanwhile, is what counts."""
        if self.subscription is not None or not self.events_on:
            return
        if batch is None:
            self.tap.clear()
        else:
            self.relayed_batches += 1
            self.tap.apply(batch)

    def matched(self) -> None:
        """The hash self-check passed here: the other processes report it too."""
        self.hashes_match = True
        if self.on_match is not None:
            self.on_match(self.name)

    def relayed_off(self) -> None:
        """The subscribing process found the engine's hashes are not ours: feedback mode."""
        if self.events_on:
            self.events_on = False
            self.tap.clear()

    # --- the overhead credit ----------------------------------------------------------------
    def served(self, prompt_tokens: int) -> None:
        """A client's request was served through this proxy: it earns retention its share,
        unless the engine's own counter says what all clients were served (see ``earn``)."""
        if self.queries_seen is None:
            self.overhead.earn(prompt_tokens)

    def sent(self, prompt_tokens: int) -> None:
        """Retention sent these prompt tokens (counted when sent, not earned: ``earn``)."""
        self.retention_sent += prompt_tokens

    def earn(self, queries: float | None) -> None:
        """Credit from the engine's ``prefix_cache_queries`` counter (prompt tokens it scheduled,
        whoever sent them) less the prompt tokens retention itself sent since the last reading.
        A counter that went back (the engine restarted) counts from zero."""
        if queries is None:
            return
        if self.queries_seen is None:
            self.queries_seen, self.retention_sent = queries, 0
            return
        delta = queries - self.queries_seen if queries >= self.queries_seen else queries
        # the engine counts a touch when it schedules it, which can fall in the next reading:
        # what retention sent beyond this reading's growth is carried over, never forgiven
        earned = delta - self.retention_sent
        self.overhead.earn(int(max(0.0, earned)))
        self.queries_seen, self.retention_sent = queries, int(max(0.0, -earned))

    # --- load and horizon ---------------------------------------------------------------------
    async def scrape(self, now: float, max_age_s: float = SCRAPE_EVERY_S) -> None:
        """Refresh ``load`` (and the credit) from /metrics when older than ``max_age_s``."""
        if now - self.last_scrape < max_age_s:
            return
        self.last_scrape = now
        try:
            m = await self.adapter.metrics()
        except AdapterError:
            return
        self.earn(m.prefix_cache_queries)
        pool = (m.cache_config.num_blocks if m.cache_config else None) or (
            self.adapter.cache.num_blocks
        )
        if pool:
            self.load = EngineLoad(
                pool_blocks=pool,
                kv_cache_usage=m.kv_cache_usage,
                waiting=m.waiting,
                running=m.running,
            )
            if self.on_scraped is not None:  # the other workers and replicas read it too
                self.on_scraped(self.name, self.load)

    def shared_load(self, load: EngineLoad) -> None:
        """The load another process scraped (it holds this engine's lease); kept unless this
        process scraped lately itself."""
        if time.time() - self.last_scrape > 2 * SCRAPE_EVERY_S:
            self.load = load

    async def fresh_load(self, max_age_s: float = 0.5) -> EngineLoad | None:
        """The engine's load, scraped again when the last reading is older than ``max_age_s``."""
        await self.scrape(time.time(), max_age_s)
        return self.load

    def horizon(self, now: float) -> float:
        """How long a block freed now survives: the smaller of the eviction-age and fill-time
        estimates (inf = unknown)."""
        candidates: list[tuple[float, str]] = []
        est = self.estimator.estimate(now)
        if est.known:
            candidates.append((est.seconds, est.source.value))
        if self.load is not None and self.has_events:
            fill = fill_time_horizon(self.load.free_blocks, self.tap.stores.rate(now))
            if math.isfinite(fill):
                candidates.append((fill, "fill_rate"))
        self.horizon_s, self.horizon_source = min(candidates, default=(math.inf, "unknown"))
        return self.horizon_s

    def observe_resume(
        self, gap_s: float, cached: int, prompt: int, previous: int, now: float | None = None
    ) -> None:
        """Feedback mode: a resume after ``gap_s`` found ``cached`` of the tokens that would
        hit if the previous prompt (``previous`` tokens) were still resident (at ``now``)."""
        bs = self.adapter.cache.block_size
        expected = min(previous, prompt - 1) // bs * bs
        if expected > 0:
            self.estimator.observe_resume(gap_s, cached, expected, now or time.time())

    # --- residency ----------------------------------------------------------------------------
    def resident_prefix(self, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` resident on the GPU (0 without events)."""
        return self.index.resident_prefix(blocks) if blocks else 0

    def resident(self, blocks: Sequence[int]) -> int | None:
        """With KV events: leading blocks the engine still holds (None: unknown)."""
        if not self.has_events or not blocks:
            return None
        return self.index.resident_prefix(blocks)

    def note_used(self, blocks: Iterable[int], at: float) -> None:
        self.tap.note_used(blocks, at)

    def pool_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds, once its metrics told its pool size."""
        return None if self.load is None else self.load.pool_blocks * self.block_size

    def view(self) -> dict[str, Any]:
        """The signals as the admin API shows them."""
        o = self.overhead
        return {
            "mode": self.mode,
            # whether this process follows the engine's KV events itself (the lease holder) or
            # learns them from the one that does
            "kv_events": {
                "subscribed": self.subscribed,
                "source": ("relay" if self.events_on else None) if not self.subscribed else "own",
                "relayed_batches": self.relayed_batches,
            },
            "horizon_s": None if math.isinf(self.horizon_s) else round(self.horizon_s, 3),
            "horizon_source": self.horizon_source,
            "block_size": self.block_size,
            "pool_blocks": self.load.pool_blocks if self.load else None,
            "resident_blocks": {m: self.index.size(m) for m in self.index.media()},
            "overhead": {
                "max_share": o.config.share,
                # what earns the credit: the engine's query counter (every client's traffic)
                # or, until it has been read, the traffic this proxy forwarded
                "earned_from": "engine" if self.queries_seen is not None else "proxy",
                "credit_tokens": round(o.credit, 1),
                "touch_estimate_tokens": round(o.touch_estimate, 1),
                "recomputed_tokens": int(o.spent),
                # beyond the one bucket of debt an accident may leave (charged to the guard)
                "forgiven_tokens": int(o.forgiven),
                "declined": o.declined,
            },
        }
