"""Retention behind the scenes: protect, expire, evict, offload and prefetch on unmodified engines.

Per engine, one proxy replica (the holder of a Redis lease) subscribes to its KV events and
drives a tick loop:

1. expire TTLs whose deadline passed (the deadline ZSET is the timer wheel);
2. read the engine's signals (``proxy.signals``): its load and LRU horizon, how long a block
   freed now survives;
3. pin sessions in the offload tier (``proxy.tiers``); sessions the tier holds need no touches;
4. apply the soft-TTL budget (``policy.budget``): protections beyond the share of the pool lapse,
   least valuable first, reported as ``pressure_override``;
5. touch the protected sessions whose prefix age approaches the horizon (``policy.keepalive``)
   through the touch runner (``proxy.touches``), within the overhead credit.

Every decision is a pure function in ``policy/``; this module gathers inputs and executes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence

from policy import (
    BudgetConfig,
    BudgetSession,
    KeepaliveConfig,
    OverheadBudget,
    OverheadConfig,
    ProtectedSession,
    effective_budget,
    plan_budget,
    plan_touches,
    touch_interval,
)
from proxy.admin_models import (
    EngineResidency,
    GuardView,
    RetentionView,
    SessionResidency,
)
from proxy.block_cache import BlockCache
from proxy.console_models import TierPins
from proxy.driven import Driven
from proxy.engine_state import EngineState
from proxy.guards import Guards
from proxy.keys import SessionKey
from proxy.metrics import Metrics
from proxy.settings import RetentionSettings
from proxy.store import Session, SessionStore, StoreDown, Upserted, Usage
from proxy.tiers import TierKeeper
from proxy.touches import TouchRunner, mark_lost, urgent

log = logging.getLogger("kvkeeper.retention")

# block ids of a protected session are re-learned (a tokenize) once it has paused this long
RELEARN_IDLE_S = 1.0
# the most of the wall time retention's ticks may take; a longer tick waits longer for the next
MAX_TICK_SHARE = 0.2
# without KV events and before the horizon is learned: touch protected sessions this often
FALLBACK_TOUCH_INTERVAL_S = 30.0
# touch a protected prefix once it has used this share of the LRU horizon (or fallen this share
# of the free queue back); at most this many touches in flight per engine
SAFETY_FRACTION = 0.5
MAX_CONCURRENT_TOUCHES = 4
# size of the per-engine overhead token bucket (starts full): the first touches before any
# prompt tokens were served
OVERHEAD_BURST_TOKENS = 4096
# the Redis lease by which one proxy replica drives an engine's retention (takeover time)
LEASE_TTL_S = 3.0


def key_of(session: Session) -> SessionKey:
    return SessionKey(session.tenant, session.session_id)


class Retention:
    """The retention layer: the per-engine lease loops and their tick, plus request-path hooks."""

    def __init__(
        self,
        store: SessionStore,
        engines: Sequence[EngineState],
        settings: RetentionSettings,
        metrics: Metrics,
        *,
        tiers: TierKeeper,
        blocks: BlockCache | None = None,
        touches: TouchRunner | None = None,
        guards: Guards | None = None,
    ) -> None:
        self.store = store
        self.engines: Mapping[str, EngineState] = {e.name: e for e in engines}
        self.settings = settings
        self.metrics = metrics
        for es in engines:
            es.signals.overhead = OverheadBudget(
                OverheadConfig(
                    share=settings.max_overhead_share,
                    burst_tokens=float(OVERHEAD_BURST_TOKENS),
                )
            )
        self.blocks = blocks or BlockCache(store, self.engines)
        self.touches = touches or TouchRunner(store, self.blocks, metrics)
        self.tiers = tiers
        # retention's measured effect per engine: touches, warm-ups and new pins stop where
        # their cost outweighs the hits they bought (policy/guard.py)
        self.guards = guards
        self.touches.guards = guards
        self.tiers.guards = guards
        self.tiers.contexts = self.blocks.contexts  # one decode/tokenize per context version
        self.holder = uuid.uuid4().hex[:12]
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._driven: dict[str, Driven] = {}  # per engine: the protected sessions it drives
        self._keepalive = KeepaliveConfig(
            safety_fraction=SAFETY_FRACTION,
            max_concurrent_touches=MAX_CONCURRENT_TOUCHES,
            unknown_horizon_interval_s=FALLBACK_TOUCH_INTERVAL_S,
        )

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self, *, discover_cache: bool = True) -> None:
        for es in self.engines.values():
            await es.signals.connect(discover_cache=discover_cache)
            self._tasks.append(asyncio.create_task(self._run(es), name=f"retention {es.name}"))

    async def stop(self) -> None:
        # A stop flag as well as cancel(): a cancellation swallowed deep inside a client library
        # must not leave a worker running (or stop() waiting for it) forever.
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self.touches.finish()  # touches in flight end rather than being aborted
        for es in self.engines.values():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self.tiers.release(es)
            await es.signals.aclose()
            self.metrics.child(self.metrics.kv_event_subscriptions, es.name).set(0)
            with contextlib.suppress(StoreDown):
                await self.store.release_lease(f"engine:{es.name}", self.holder)

    # --- request path hooks -------------------------------------------------------------------
    def served(self, engine: str, prompt_tokens: int) -> None:
        """A client's request on ``engine`` was served through this proxy (overhead credit)."""
        es = self.engines.get(engine)
        if es is not None:
            es.signals.served(prompt_tokens)

    def on_completion(
        self, engine: str, usage: Usage | None, before: Upserted, key: SessionKey | None = None
    ) -> None:
        """After a hinted request of session ``key``: credit the guard with what retention had
        kept for it (if its pause outlasted the engine's LRU horizon), and feed the horizon in feedback mode. A resumed session whose
        prompt extends its previous one would hit all of that prompt's full blocks if they
        were still resident; fewer cached tokens after a gap bound the horizon below it."""
        es = self.engines.get(engine)
        signals = es.engine.signals if es is not None else None
        if usage is None:
            return
        now = time.time()
        if self.guards is not None and key is not None:
            # the horizon only for a session retention kept something for (resumed credits it)
            self.guards.resumed(
                engine,
                key,
                usage.cached_tokens,
                now,
                last_active=before.last_active,
                horizon_of=signals.horizon if signals is not None else None,
            )
        if signals is None or signals.events_on or not before.last_active:
            return
        signals.observe_resume(
            now - before.last_active,
            usage.cached_tokens,
            usage.prompt_tokens,
            before.last_prompt_tokens,
            now,
        )

    def forget(self, key: SessionKey) -> None:
        self.blocks.forget(key)
        for d in self._driven.values():
            d.relearn(key)
        if self.guards is not None:
            self.guards.forget(key)

    def engine_for(self, session: Session) -> EngineState:
        """The engine that serves ``session`` (not yet routed: the first one)."""
        return self.engines.get(session.engine or "") or next(iter(self.engines.values()))

    # --- the worker -----------------------------------------------------------------------------
    async def _run(self, es: EngineState) -> None:
        pause = self.settings.tick_s
        lease = f"engine:{es.name}"
        ttl_ms = int(LEASE_TTL_S * 1000)
        while not self._stopping.is_set():
            try:
                token = await self.store.lease(lease, self.holder, ttl_ms)
                if token and token != es.leader_token:
                    log.info("retention: %s now drives %s (fence %d)", self.holder, es.name, token)
                    es.signals.subscribe()  # one KV-event subscriber per engine: the holder
                    await self.tiers.adopt(es)
                elif not token and es.leader_token:
                    self.tiers.abandon(es)
                if not token:  # another holds it (not after StoreDown: maybe nobody does)
                    await es.signals.unsubscribe()
                es.leader_token = token
                subscribed = int(es.signals.subscribed)
                self.metrics.child(self.metrics.kv_event_subscriptions, es.name).set(subscribed)
                if token:
                    started = time.perf_counter()
                    await self.tick(es, time.time())
                    took = time.perf_counter() - started
                    self.metrics.child(self.metrics.retention_tick, es.name).observe(took)
                    # the tick shares the data plane's event loop and cores: at most
                    # MAX_TICK_SHARE of the wall time, so requests do not queue behind ticks on
                    # a starved machine (and well within the lease, which the next pass renews)
                    stretch = min(took / MAX_TICK_SHARE - took, LEASE_TTL_S / 3)
                    pause = max(self.settings.tick_s, stretch)
                for key in await self.blocks.prune(time.time()):  # leader or not
                    self.forget(key)
            except StoreDown:  # the lease may pass to another replica meanwhile
                if es.leader_token:
                    self.tiers.abandon(es)
                es.leader_token = 0
            except Exception:  # a bad tick must not end the worker
                log.exception("retention tick failed on %s", es.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pause)
            pause = self.settings.tick_s

    async def tick(self, es: EngineState, now: float) -> None:
        await self._expire(now)
        await es.signals.scrape(now)
        horizon = es.signals.horizon(now)
        self.metrics.child(self.metrics.horizon, es.name).set(horizon)
        d = self._driven.setdefault(es.name, Driven())
        await d.sync(self.store, now, lambda s: self._drives(es, s))
        await d.learn(self.blocks, RELEARN_IDLE_S)
        # sessions the offload tier holds resume by a load, not a re-prefill: no touches (and
        # the pins of sessions no longer protected are released, so this runs with none too)
        held: set[SessionKey] = set()
        if es.tier is not None:
            held = await self.tiers.tick(es, list(d.sessions.values()), d.blocks, now)
        held &= d.sessions.keys()
        if len(held) == len(d.sessions):
            return
        kept = self._budget(es, d, held, now)
        if self.guards is None or self.guards.allows(es.name, now):
            signals = es.signals  # passed by the allocation front: as in urgent() (inf: never)
            free = signals.load.free_blocks if signals.load and signals.has_events else math.inf
            interval, limit = touch_interval(horizon, self._keepalive), SAFETY_FRACTION * free
            due = d.due(es.in_flight, held, kept, interval, signals.tap.allocated_since, limit, now)
            self._touch(es, due, d.blocks, horizon, now, d.clients(held, kept))
        if es.lost:  # forget the losses of sessions no longer protected here
            es.lost = {k: v for k, v in es.lost.items() if k in d.sessions and k not in held}
        self.metrics.overhead_credit.labels(es.name).set(es.signals.overhead.credit)

    def _touch(
        self,
        es: EngineState,
        sessions: list[Session],
        blocks: dict[SessionKey, tuple[int, ...]],
        horizon: float,
        now: float,
        clients: int = 0,
    ) -> None:
        """Touch what the keep-alive plan picks and what the allocation front reached (none
        while the guard holds retention back on this engine); the client-protected sessions
        first, and a guessed one only within the credit ``clients`` such sessions leave."""
        if self.guards is not None and not self.guards.allows(es.name, now):
            return
        by_key = {key_of(s): s for s in sessions}
        plan = plan_touches(
            [
                ProtectedSession(
                    session_id=k,
                    last_active_at=s.last_active,
                    ttl_until=s.ttl_until,
                    n_blocks=len(blocks[k]),
                    touch_in_flight=k in es.in_flight,
                    value=float(max(1, len(blocks[k]))),
                    guessed=s.guessed,
                )
                for k, s in by_key.items()
            ],
            horizon,
            now,
            self._keepalive,
        )
        picked = {*map(SessionKey._make, plan.touch), *urgent(es, sessions, SAFETY_FRACTION)}
        reserve = es.signals.overhead.guessed_reserve(clients)
        for key in sorted(picked, key=lambda k: by_key[k].guessed):
            session = by_key[key]
            if es.lost.get(key) == session.last_used:
                continue  # found evicted, and nothing new recorded since
            current = self.blocks.current(key, session.last_used)
            if current and es.signals.resident(blocks[key]) == 0:
                mark_lost(es, session, self.metrics)
                continue
            reserved = es.signals.overhead.admit_touch(reserve=reserve * session.guessed)
            if reserved is None:  # yielded: a guess's touch the credit (and reserve) did not cover
                outcome = "yielded" if session.guessed else "over_budget"
                self.metrics.touches.labels(es.name, outcome).inc()
                continue
            self.touches.spawn_session(es, session, reserved)

    def _budget(
        self, es: EngineState, d: Driven, held: set[SessionKey], now: float
    ) -> set[SessionKey] | None:
        """Sessions whose protection fits the soft-TTL budget (None: all of them); the rest
        lapse (pressure_override). When every block of every session fits, all fit: no sort."""
        load = es.signals.load
        if load is None:
            return None
        config = BudgetConfig(share=self.settings.budget_share)
        if not held and len(d.refs) <= effective_budget(load, config)[0]:
            es.overridden = set()
            self.metrics.protected_sessions.labels(es.name).set(len(d.sessions))
            self.metrics.protected_blocks.labels(es.name).set(len(d.refs))
            return None
        sessions = {k: s for k, s in d.sessions.items() if k not in held}  # keyed as key_of
        everyone, blocks = set(sessions), d.blocks
        decision = plan_budget(
            [
                BudgetSession(k, blocks[k], _value(s, blocks, now), s.guessed)
                for k, s in sessions.items()
            ],
            load,
            config,
        )
        overridden = {SessionKey(*k) for k in decision.pressure_override}
        for key in overridden - es.overridden:
            self.metrics.pressure_overrides.inc()
            log.info("pressure_override: %s/%s protection lapses on %s", *key, es.name)
        es.overridden = overridden
        self.metrics.protected_sessions.labels(es.name).set(len(everyone - overridden))
        self.metrics.protected_blocks.labels(es.name).set(decision.protected_blocks)
        return everyone - overridden

    def _drives(self, es: EngineState, session: Session) -> bool:
        if session.engine is not None:
            return session.engine == es.name
        return es is next(iter(self.engines.values()))  # not yet routed: the first engine

    async def _expire(self, now: float) -> None:
        for tenant, sid in await self.store.due(now):
            if await self.store.expire(tenant, sid, now):
                self.metrics.expiries.inc()

    # --- views ------------------------------------------------------------------------------------
    def engine_view(self, name: str) -> RetentionView | None:
        """What retention holds on one engine (None: it does not drive that engine)."""
        es = self.engines.get(name)
        if es is None:
            return None
        guard = self.guards.view(name, time.time()) if self.guards is not None else None
        return RetentionView(
            **es.signals.view(),
            mode_note=(
                "KV events: horizon from allocation rate and eviction ages"
                if es.signals.has_events
                else "no KV events: horizon from cached_tokens feedback, touches every "
                f"{FALLBACK_TOUCH_INTERVAL_S:g}s until learned"
            ),
            leader=bool(es.leader_token),
            offload_tier=es.tier is not None,
            tier_pinned=TierPins.model_validate(self.tiers.pinned(name))
            if es.tier is not None
            else None,
            touches_in_flight=len(es.in_flight),
            touch_latency_s=round(es.touch_latency.get(), 4),
            touch_trimmed_blocks=es.trimmed_blocks,
            guard=GuardView.model_validate(guard) if guard is not None else None,
            scheduling_policy=getattr(es.adapter, "scheduling_policy", None),
            admission_priorities=bool(getattr(es.adapter, "prioritized", False)),
            pressure_overrides_now=len(es.overridden),
        )

    async def residency(self, session: Session) -> SessionResidency:
        """Per engine: the leading blocks of the session's prompt resident per medium."""
        blocks = await self.blocks.blocks_of(key_of(session), session)
        return SessionResidency(
            blocks=len(blocks),
            engines={
                name: EngineResidency(
                    resident_prefix_blocks=es.signals.index.prefix_by_medium(blocks)
                    if blocks
                    else {}
                )
                for name, es in self.engines.items()
            },
        )


def _value(session: Session, blocks: dict[SessionKey, tuple[int, ...]], now: float) -> float:
    """Budget value: recompute cost (blocks) per second of protection still to pay for."""
    n = len(blocks[key_of(session)])
    return max(1, n) / max(1.0, session.ttl_left(now))
