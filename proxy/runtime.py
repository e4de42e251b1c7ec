"""The live state of one kvkeeper process, shared by handlers and workers through one AppKey."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from policy import ReturnWindow, ReturnWindowConfig
from proxy.auth import TenantMap
from proxy.edits import EditExecutor, UnsupportedEdits
from proxy.hint_model import Hint
from proxy.metrics import Metrics
from proxy.placement import Placer
from proxy.settings import Settings
from proxy.store import SessionStore, StoreDown, StoreRejected, Upserted
from proxy.upstream import EnginePool

if TYPE_CHECKING:
    from proxy.completions import CompletionWriter
    from proxy.known import KnownSessions
    from proxy.longterm import LongRetention
    from proxy.prefix_share import PrefixShare
    from proxy.retention import Retention

log = logging.getLogger("kvkeeper.runtime")

MAX_RETURNED = 100_000  # sessions remembered as having returned (their pauses no longer sampled)
# a returning session is protected again once less than this share of its window is left
PROTECT_AGAIN_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class Registration:
    """What the session plane said about a hinted request."""

    outcome: str  # the X-KVKeeper-Hint header value
    upserted: Upserted | None  # None when the hint could not be recorded
    behind: bool = False  # a known session's repeat: its upsert is written behind


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics
    tenants: TenantMap
    pool: EnginePool
    store: SessionStore | None
    edits: EditExecutor = field(default_factory=UnsupportedEdits)
    retention: Retention | None = None
    longterm: LongRetention | None = None  # retention beyond the GPU cap (proxy/longterm.py)
    completions: CompletionWriter | None = None
    known: KnownSessions | None = None  # repeats of known sessions skip the upsert's round trip
    placer: Placer = field(init=False)
    prefix_share: PrefixShare | None = None  # the placer's prefix index shared with replicas
    returns: ReturnWindow | None = None  # protection of sessions returning without a TTL
    # sessions seen returning: the protection deadline this process last set (0: none)
    _returned: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)
    started: float = field(default_factory=time.time)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.placer = Placer(self.pool, self.settings.placement, self.metrics)
        factor = self.settings.retention.return_ttl_factor
        if self.returns is None and factor > 0 and self.settings.retention.enabled:
            self.returns = ReturnWindow(
                ReturnWindowConfig(factor=factor, max_ttl_s=self.settings.limits.max_ttl_s)
            )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run work off the hot path; keep a reference so it is not collected mid-flight."""
        self.keep(asyncio.create_task(coro))

    def keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a started task until it ends (drained at shutdown, failures logged)."""
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task failed: %r", exc)

    async def drain(self, grace_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)

    async def settle(self) -> None:
        """Write finished requests still buffered, so the next read sees them."""
        if self.completions is not None:
            with contextlib.suppress(StoreDown):
                await self.completions.flush()

    def register_repeat(self, tenant: str, hint: Hint) -> Registration | None:
        """A repeat of a session Redis accepted a moment ago: accepted without a round trip,
        its upsert written behind (``proxy/known.py``); None when it must register."""
        known, store, completions = self.known, self.store, self.completions
        if known is None or completions is None or store is None or not store.answering:
            return None
        up = known.repeat(tenant, hint, time.time())
        if up is None:
            return None
        completions.wake()
        self.metrics.child(self.metrics.hint_outcomes, "accepted", "").inc()
        self._protect_return(tenant, hint, up)
        if hint.notes or hint.parent_session_id:
            notes = "".join(f"; note={n}" for n in hint.notes)
            return Registration("accepted" + notes, self._with_buffered(tenant, hint, up), True)
        # its own buffered completions are already in what is known (KnownSessions.completed)
        return Registration("accepted", up, True)

    async def register(self, tenant: str, hint: Hint) -> Registration:
        """Upsert the hint's session; never raises: Redis trouble fails open."""
        notes = "".join(f"; note={n}" for n in hint.notes)
        if self.store is None:
            return Registration("rejected; reason=store_unavailable", None)
        try:
            up = await self.store.upsert(tenant, hint, time.time())
        except StoreRejected as exc:
            self.metrics.child(self.metrics.hint_outcomes, "rejected", exc.reason).inc()
            return Registration(f"rejected; reason={exc.reason}", None)
        except StoreDown:
            self.metrics.fail_open.inc()
            self.metrics.child(self.metrics.hint_outcomes, "rejected", "store_unavailable").inc()
            return Registration("rejected; reason=store_unavailable", None)
        if up.created:
            self.metrics.sessions_created.inc()
        up = self._with_buffered(tenant, hint, up)
        if self.known is not None:  # with its buffered completions: repeats need not look
            self.known.accepted(tenant, hint, up)
        self.metrics.child(self.metrics.hint_outcomes, "accepted", "").inc()
        self._protect_return(tenant, hint, up)
        return Registration("accepted" + notes, up)

    def _protect_return(self, tenant: str, hint: Hint, up: Upserted) -> None:
        """A session back without a TTL hint: protect it for the learned window
        (``policy/returns.py``); its first return's pause teaches the window. A repeat while
        most of the window this process last set is still ahead sends nothing."""
        returns, store = self.returns, self.store
        if returns is None or store is None:
            return
        key = (tenant, hint.session_id)
        if hint.ttl_s is not None or up.created:  # its own TTL (or a new session) decides
            if key in self._returned:
                self._returned[key] = 0.0  # whatever this process protected it until is void
            return
        if up.last_active <= 0:
            return
        now = time.time()
        until = self._returned.get(key)
        if until is not None:
            self._returned.move_to_end(key)
        else:  # its first return seen here: later pauses are shortened by its own touches
            returns.observe(now - up.last_active)
            until = 0.0
            if len(self._returned) >= MAX_RETURNED:
                self._returned.popitem(last=False)
        ttl = returns.ttl()
        if ttl is None:
            self._returned[key] = until
            return
        if until - now >= (1.0 - PROTECT_AGAIN_FRACTION) * ttl:
            self._returned[key] = until  # protected a moment ago: nothing new to say
            return
        self._returned[key] = now + ttl
        self.spawn(self._protect(store, tenant, hint.session_id, now, ttl))

    async def _protect(
        self, store: SessionStore, tenant: str, sid: str, now: float, ttl: float
    ) -> None:
        ok = False
        with contextlib.suppress(StoreDown):
            ok = await store.protect(tenant, sid, now, ttl, guessed=True)
        if ok:
            self.metrics.return_protections.inc()
        elif (tenant, sid) in self._returned:  # not protected after all: the next return asks
            self._returned[(tenant, sid)] = 0.0

    async def unregister_failed(
        self, tenant: str, hint: Hint, registering: Registration | asyncio.Future[Registration]
    ) -> None:
        """The request failed upstream: a session its registration created is removed again
        (kept if another request has used it meanwhile); a kept one is not left ``active``."""
        reg = registering if isinstance(registering, Registration) else await registering
        if reg.upserted is None or self.store is None:
            return
        if reg.behind:  # its upsert, written behind, goes first
            await self.settle()
        with contextlib.suppress(StoreDown):
            if await self.store.unregister(tenant, hint, time.time()):
                self.metrics.child(self.metrics.hint_outcomes, "unregistered", "").inc()

    def _with_buffered(self, tenant: str, hint: Hint, up: Upserted) -> Upserted:
        """Newer facts of this process's still-buffered completions override Redis's."""
        if self.completions is None:
            return up
        own = self.completions.latest(tenant, hint.session_id)
        parent = (
            self.completions.latest(tenant, hint.parent_session_id)
            if hint.parent_session_id
            else None
        )
        engine, last_active, last_prompt = up.engine, up.last_active, up.last_prompt_tokens
        if own is not None and own[1] >= last_active:
            engine, last_active, last_prompt = own
        parent_engine = parent[0] if parent is not None else up.parent_engine
        if (engine, last_active, last_prompt, parent_engine) == (
            up.engine,
            up.last_active,
            up.last_prompt_tokens,
            up.parent_engine,
        ):  # a known repeat: its own completion is already applied (KnownSessions.completed)
            return up
        return Upserted(up.created, engine, parent_engine, last_active, last_prompt)


RUNTIME = web.AppKey("runtime", Runtime)
