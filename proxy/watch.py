"""Loud configuration: the state of Redis and of every engine logged at start and on change.

``kvkeeper_redis_up`` follows Redis (a ping every ``interval_s`` and every failed store call);
``kvkeeper_engine_up`` is set by the engine pool's health checks. The first round's results are
logged at start, one line per dependency, so a wrong URL shows in the first second of the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from proxy.metrics import Metrics
from proxy.store import SessionStore
from proxy.upstream import EnginePool

log = logging.getLogger("kvkeeper.watch")


class StoreWatch:
    """Redis reachability: a gauge plus one log line per transition."""

    def __init__(self, metrics: Metrics, where: str) -> None:
        self.metrics = metrics
        self.where = where  # the URL without credentials, for the log
        self.up: bool | None = None
        self.store: SessionStore | None = None

    def set(self, up: bool, detail: str = "") -> None:
        self.metrics.redis_up.set(1 if up else 0)
        if up == self.up:
            return
        first, self.up = self.up is None, up
        if up:
            log.info("redis at %s is %s", self.where, "reachable" if first else "reachable again")
        else:
            log.error(
                "redis at %s is unreachable%s: hints answer 'rejected; reason=store_unavailable' "
                "and requests are forwarded without session features until it is back",
                self.where,
                f" ({detail})" if detail else "",
            )

    def failed(self) -> None:
        """A store call failed (the store's ``on_error``); the first state is the ping's."""
        if self.up:
            self.set(False, "a store call failed")

    async def check(self) -> bool:
        """Ping Redis (directly, so the log line can say why it failed)."""
        if self.store is None:
            return False
        try:
            ok, detail = bool(await self.store.redis.ping()), ""
        except Exception as exc:  # any failure is "unreachable"; the reason goes in the log
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        self.set(ok, detail)
        return ok


def redacted(url: str) -> str:
    """``redis://:secret@host:6379/0`` -> ``redis://***@host:6379/0``."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return url


async def watch(
    pool: EnginePool, store: StoreWatch, interval_s: float, stopping: asyncio.Event
) -> None:
    """Log each engine's and Redis's state once at start, then keep Redis's gauge current
    (engine transitions are logged by the pool's health checks). Ends when ``stopping`` is set:
    a cancellation swallowed inside the Redis client must not keep it running."""
    await asyncio.gather(*(pool.check(e) for e in pool.engines))
    for e in pool.engines:
        if e.healthy:
            log.info("engine %s at %s is up", e.name, e.url)
        else:
            log.error("engine %s at %s is down (%s)", e.name, e.url, e.last_error or "unknown")
    if not any(e.healthy for e in pool.engines):
        log.error("no engine is up: /readyz answers 503 and requests fail until one is")
    while not stopping.is_set():
        await store.check()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), interval_s)
