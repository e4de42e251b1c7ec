"""``create_app``: the aiohttp application with its resources opened and closed in cleanup_ctx."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from redis.asyncio import Redis

from adapters.base import AdapterError, CacheConfig
from adapters.lmcache import LMCacheAdapter, LMCacheConfig
from adapters.registry import AdapterSpec, create_adapter
from policy.admission import admission_priority
from proxy import redisconn
from proxy.access import access_log
from proxy.admin import add_admin_routes
from proxy.auth import TenantMap
from proxy.block_cache import BlockCache
from proxy.completions import CompletionWriter
from proxy.console import add_console_routes
from proxy.edits import EditExecutor
from proxy.embedded import EmbeddedRedis
from proxy.engine_state import EngineState
from proxy.errors import (
    PayloadTooLarge,
    RequestTimeout,
    ServerBusy,
    error_middleware,
)
from proxy.guards import Guards
from proxy.hashcheck import HASH_CHECKS, check_engines
from proxy.known import KnownSessions
from proxy.longterm import LongRetention
from proxy.metrics import Metrics
from proxy.operations import SessionOps
from proxy.passthrough import RESPONSES, ResponseMap, add_passthrough
from proxy.prefix_share import PrefixShare
from proxy.residency_share import ResidencyShare
from proxy.retention import Retention
from proxy.routes import add_routes, count_requests
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import Limits, Settings
from proxy.store import SessionStore
from proxy.tiers import TierKeeper
from proxy.touches import TouchRunner
from proxy.upstream import Engine, EnginePool, make_client
from proxy.watch import StoreWatch, redacted, watch
from proxy.workers import worker_count

log = logging.getLogger("kvkeeper.app")

# Redis on the hot path must fail fast: a dead or hung Redis may not stall requests.
REDIS_TIMEOUT_S = 0.5


def open_redis(url: str) -> Redis:
    return redisconn.open_redis(
        url,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        health_check_interval=15,
        max_connections=256,
    )


def _touch_priority() -> int:
    """Touches and warm-ups: due now (their prefixes are resident, a late touch is wasted)."""
    return admission_priority(time.time(), 0.0)


def build_engines(settings: Settings, client: aiohttp.ClientSession) -> list[Engine]:
    """One engine per spec, each behind the adapter its ``kind`` names."""
    cache = CacheConfig(
        block_size=settings.cache.block_size or 32, hash_seed=settings.cache.hash_seed
    )
    priority = _touch_priority if settings.admission.enabled is not False else None
    engines = []
    for spec in settings.engines:
        adapter = create_adapter(
            spec.kind, AdapterSpec(spec.label, spec.url, spec.events, cache, priority), client
        )
        # stamped from the start only when configured; with None, once the engine said it
        # schedules by priority (detect_scheduling)
        adapter.prioritized = settings.admission.enabled is True
        engines.append(Engine(spec, adapter))
    return engines


def build_retention(
    settings: Settings, store: SessionStore, pool: EnginePool, metrics: Metrics
) -> Retention:
    """The retention layer and its parts, each from its own settings group."""
    states = []
    for engine in pool.engines:
        lmc = engine.spec.lmcache
        tier = None
        if lmc is not None:
            tier = LMCacheAdapter(
                pool.client,
                LMCacheConfig(
                    coordinator_url=lmc.coordinator_url,
                    server_url=lmc.server_url,
                    model_name=lmc.model_name,
                ),
            )
        states.append(EngineState(engine=engine, tier=tier))
    r = settings.retention
    blocks = BlockCache(store, {es.name: es for es in states})
    touches = TouchRunner(store, blocks, metrics)
    return Retention(
        store,
        states,
        r,
        metrics,
        tiers=TierKeeper(store, settings.tier, metrics),
        guards=Guards(
            settings.guard, metrics, workers=worker_count(settings.workers) if settings.port else 1
        ),
        blocks=blocks,
        touches=touches,
    )


def server_options(settings: Settings) -> dict[str, Any]:
    """Options of aiohttp's server for ``run_app`` / ``AppRunner``: a connection that has not
    sent a complete request line and headers ``header_timeout_s`` after it opened or after its
    last answer is closed (slowloris); after an answer given with its body unread (413, 408),
    the rest of the body is read and dropped for 2 s at most before the connection closes."""
    return {"keepalive_timeout": settings.limits.header_timeout_s, "lingering_time": 2.0}


class _BodyBudget:
    """Request bodies in memory, all requests together, bounded: a body is read only once its
    declared size (or the per-request cap when chunked) fits the budget."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def middleware(self, limits: Limits) -> Middleware:
        @web.middleware
        async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.body_exists:
                return await handler(request)
            size = request.content_length
            if size is not None and size > limits.max_body_bytes:
                raise PayloadTooLarge(
                    f"request body is larger than {limits.max_body_bytes} bytes",
                    code="body_too_large",
                )
            need = size if size is not None else limits.max_body_bytes
            if self.held + need > self.limit:
                raise ServerBusy(
                    "too many request bodies in flight; retry shortly", code="server_busy"
                )
            self.held += need
            try:
                try:
                    async with asyncio.timeout(limits.body_timeout_s):
                        await request.read()  # kept by the request: handlers read it again
                except TimeoutError:
                    raise RequestTimeout(
                        f"request body not received within {limits.body_timeout_s:g} s",
                        code="body_timeout",
                    ) from None
                return await handler(request)
            finally:
                self.held -= need

        return read_body


async def detect_scheduling(retention: Retention, retry_s: float, stopping: asyncio.Event) -> None:
    """``admission.enabled`` unset: stamp admission priorities on the engines that schedule
    by them, as each reports (vLLM's dev-mode ``/server_info``); an engine that cannot be
    reached yet is asked again every ``retry_s``. One that does not say stays first come,
    first served."""
    pending = list(retention.engines.values())
    while pending and not stopping.is_set():
        waiting = []
        for es in pending:
            try:
                policy = await es.adapter.discover_scheduling_policy()
            except AdapterError:
                waiting.append(es)
                continue
            es.adapter.prioritized = policy == "priority"
            log.info(
                "%s schedules %s: admission priorities %s",
                es.name,
                policy or "(not reported)",
                "on" if es.adapter.prioritized else "off",
            )
        pending = waiting
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), retry_s)


def create_app(settings: Settings, *, edits: EditExecutor | None = None) -> web.Application:
    """Build the app; resources (client, Redis, workers) start with it and stop with it."""
    budget = _BodyBudget(settings.limits.max_inflight_body_bytes)
    app = web.Application(
        middlewares=[
            access_log,
            count_requests,
            error_middleware,
            budget.middleware(settings.limits),
        ],
        client_max_size=settings.limits.max_body_bytes,
    )
    metrics = Metrics()
    app[HASH_CHECKS] = {}
    tenants = TenantMap.from_file(settings.tenants_file)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        # the private Redis wraps the rest: stopped also when a later start-up step fails (aiohttp
        # runs no cleanup for a failed start-up)
        embedded = EmbeddedRedis() if settings.redis_url is None else None
        try:
            url = settings.redis_url
            if embedded is not None:
                url = await embedded.start()
                log.info("embedded redis at %s", url)
            assert url is not None
            async with serving(app, url, embedded=embedded is not None):
                yield
        finally:
            if embedded is not None:
                await embedded.stop()

    @contextlib.asynccontextmanager
    async def serving(app: web.Application, url: str, *, embedded: bool) -> AsyncIterator[None]:
        client = make_client(settings.upstream)
        redis = open_redis(url)
        store_watch = StoreWatch(metrics, "embedded" if embedded else redacted(url))

        known = KnownSessions(on_created=metrics.sessions_created.inc)

        def store_failed() -> None:
            metrics.redis_errors.inc()
            store_watch.failed()
            known.forget_all()  # until Redis answers again, every hint registers

        store = SessionStore(
            redis,
            settings.limits,
            namespace=settings.namespace,
            timeout_s=REDIS_TIMEOUT_S,
            on_error=store_failed,
            on_stall=metrics.redis_stalls.inc,
        )
        store_watch.store = store
        store.on_touched = known.touched
        pool = EnginePool(build_engines(settings, client), client, metrics)
        rt = Runtime(settings=settings, metrics=metrics, tenants=tenants, pool=pool, store=store)
        rt.completions = CompletionWriter(
            store, on_drop=metrics.completions_dropped.inc, known=known
        )
        rt.known = known
        if edits is not None:
            rt.edits = edits
        app[RUNTIME] = rt
        subscriber: Redis | None = None
        sharing = settings.placement.share and len(settings.engines) > 1
        if sharing or settings.retention.enabled:
            # its own client: a subscription holds its connection, and waits longer than a call
            subscriber = redisconn.open_redis(
                url, socket_connect_timeout=REDIS_TIMEOUT_S, health_check_interval=15
            )
        if sharing and subscriber is not None:
            rt.prefix_share = PrefixShare(
                redis, subscriber, settings.namespace, rt.placer.prefixes, pool.by_name
            )
            rt.placer.share = rt.prefix_share
            # an engine's load is scraped by its lease holder alone: every process gets it
            for engine in pool.engines:
                engine.signals.on_scraped = rt.prefix_share.loaded
            rt.prefix_share.on_load = lambda name, load: pool.by_name[name].signals.shared_load(
                load
            )
            rt.prefix_share.start()
        app[RESPONSES] = ResponseMap(store)
        health = asyncio.create_task(pool.health_loop(settings.health_interval_s))
        stopping = asyncio.Event()
        watching = asyncio.create_task(
            watch(pool, store_watch, settings.health_interval_s, stopping)
        )
        sweeps: asyncio.Task[None] | None = None
        checking: asyncio.Task[None] | None = None
        residency: ResidencyShare | None = None
        if settings.retention.enabled and subscriber is not None:
            # one KV-event subscriber per engine (its lease holder), relayed to the others
            residency = ResidencyShare(
                redis, subscriber, settings.namespace, {e.name: e.signals for e in pool.engines}
            )
            residency.start()
            rt.retention = build_retention(settings, store, pool, metrics)
            rt.placer.known_blocks = rt.retention.blocks.known
            await rt.retention.start(discover_cache=settings.cache.block_size is None)
            checking = asyncio.create_task(
                check_engines(rt.retention, app[HASH_CHECKS], metrics, stopping)
            )
            if settings.admission.enabled is None:
                rt.spawn(detect_scheduling(rt.retention, settings.health_interval_s, stopping))
            if edits is None:
                rt.edits = SessionOps(store, rt.retention, metrics, settings.limits.max_ttl_s)
            if any(es.tier is not None for es in rt.retention.engines.values()):
                rt.longterm = LongRetention(store, rt.retention.engines, metrics)
                sweeps = asyncio.create_task(rt.longterm.run())
                if isinstance(rt.edits, SessionOps):
                    rt.edits.longterm = rt.longterm
        try:
            yield
        finally:
            stopping.set()
            background = [health, watching, *(t for t in (sweeps, checking) if t is not None)]
            for task in background:
                task.cancel()
            await asyncio.wait(background, timeout=5)
            if rt.retention is not None:
                await rt.retention.stop()
            await rt.drain()
            for share in (rt.prefix_share, residency):
                if share is not None:
                    await share.stop()
            if subscriber is not None:
                await subscriber.aclose()
            await rt.completions.close()
            await client.close()
            await store.aclose()
            await redis.aclose()

    app.cleanup_ctx.append(resources)
    add_routes(app)
    add_admin_routes(app)
    add_console_routes(app)
    add_passthrough(app)  # last: the catch-all matches every path not routed above
    return app
