"""The live state of one kvkeeper process, shared by handlers and workers through one AppKey."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.auth import TenantMap
from proxy.edits import EditExecutor, UnsupportedEdits
from proxy.hints import Hint
from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.store import SessionStore, StoreDown, StoreRejected, Upserted
from proxy.upstream import Engine, EnginePool

if TYPE_CHECKING:
    from proxy.retention import Retention

log = logging.getLogger("kvkeeper.runtime")


@dataclass(frozen=True, slots=True)
class Registration:
    """What the session plane said about a hinted request."""

    outcome: str  # the X-KVKeeper-Hint header value
    upserted: Upserted | None  # None when the hint could not be recorded


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics
    tenants: TenantMap
    pool: EnginePool
    store: SessionStore | None
    edits: EditExecutor = field(default_factory=UnsupportedEdits)
    retention: Retention | None = None
    started: float = field(default_factory=time.time)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run work off the hot path; keep a reference so it is not collected mid-flight."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task failed: %r", exc)

    async def drain(self, grace_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)

    async def register(self, tenant: str, hint: Hint) -> Registration:
        """Upsert the hint's session; never raises: Redis trouble fails open."""
        notes = "".join(f"; note={n}" for n in hint.notes)
        if self.store is None:
            return Registration("rejected; reason=store_unavailable", None)
        try:
            up = await self.store.upsert(tenant, hint, time.time())
        except StoreRejected as exc:
            self.metrics.hint_outcomes.labels("rejected", exc.reason).inc()
            return Registration(f"rejected; reason={exc.reason}", None)
        except StoreDown:
            self.metrics.fail_open.inc()
            self.metrics.hint_outcomes.labels("rejected", "store_unavailable").inc()
            return Registration("rejected; reason=store_unavailable", None)
        if up.created:
            self.metrics.sessions_created.inc()
        self.metrics.hint_outcomes.labels("accepted", "").inc()
        return Registration("accepted" + notes, up)

    def engine_order(self, upserted: Upserted | None) -> list[Engine]:
        """Affinity first, then the parent's engine, then the least loaded (round robin on ties)."""
        engines = self.pool.engines
        start = next(self._rr) % len(engines)
        rotated = engines[start:] + engines[:start]
        ranked = sorted(rotated, key=lambda e: (not e.healthy, e.inflight))
        preferred = []
        if upserted is not None:
            for name in (upserted.engine, upserted.parent_engine):
                eng = self.pool.get(name)
                if eng is not None and eng.healthy and eng not in preferred:
                    preferred.append(eng)
        return preferred + [e for e in ranked if e not in preferred]


RUNTIME = web.AppKey("runtime", Runtime)
