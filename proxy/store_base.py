"""The session plane: per-tenant sessions, parent/child trees and TTL deadlines in Redis.

Layout (``ns`` is the namespace, default ``kvk``; every key has a Redis expiry as a safety net):

    {ns}:s:{tenant}:{sid}     HASH   the session (state, parent, engine, counters, ttl_until ...)
    {ns}:ch:{tenant}:{sid}    SET    child session ids
    {ns}:ctx:{tenant}:{sid}   STRING compressed context needed to re-send the session's prompt
    {ns}:idx:{tenant}         ZSET   sid by last_seen (listing, per-tenant bound)
    {ns}:dl                   ZSET   "tenant\\x1fsid" by TTL deadline (the timer wheel)
    {ns}:chg, {ns}:chgseq     ZSET   the same members by change sequence (``protected``'s feed)
    {ns}:tenants              SET    tenants that have sessions

On a Redis Cluster the tenant is written as a hash tag (``{ns}:s:{{tenant}}:{sid}``) and the
deadline and feed sets are per tenant (``{ns}:dl:{{tenant}}`` ...), so every script call
touches one slot. Multi-key updates are Lua scripts (``proxy/lua``). Connection failures raise
:class:`StoreDown`; after one, calls fail fast for ``cooldown_s`` so a dead Redis adds no latency.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TypeVar

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from proxy.batching import ClusterScripts, ScriptBatcher
from proxy.settings import Limits
from proxy.store_model import SEP, StoreDown, as_text

T = TypeVar("T")
# ``answering`` looks at the script connection at most this often (a request arriving in the
# same millisecond as Redis's end is as likely to have come just before it)
ANSWERING_FOR_S = 0.001
# a call timed out this many socket timeouts after it began: the event loop stalled, not Redis
STALL_FACTOR = 2.0
_SCRIPTS = (
    "upsert",
    "complete",
    "free",
    "expire",
    "touched",
    "protect",
    "lease",
    "protected",
    "unregister",
    "feed",
)


def _script(name: str) -> str:
    return resources.files("proxy").joinpath("lua", name).read_text()


class StoreBase:
    """Key names, the script runner and failure handling, shared by the store's parts."""

    def __init__(
        self,
        redis: Redis,
        limits: Limits,
        *,
        namespace: str = "kvk",
        cooldown_s: float = 1.0,
        timeout_s: float | None = None,
        on_error: Callable[[], None] | None = None,
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        self.redis = redis
        self.limits = limits
        self.ns = namespace
        self._cooldown_s = cooldown_s
        self._timeout_s = timeout_s  # the clients' socket timeout (None: not known)
        self._on_stall = on_stall  # told of each timeout put down to a stalled event loop
        self._down_until = 0.0
        self._answered_at = -1e9  # when ``answering`` last found the script connection open
        self._on_error = on_error
        self._known_tenants: set[str] = set()
        sources = {name: _script(f"{name}.lua") for name in _SCRIPTS}
        # a Redis Cluster: keys hash-tagged per tenant, each script call routed by its slot
        self.cluster = isinstance(redis, RedisCluster)
        self._tag = "1" if self.cluster else "0"  # scripts that derive key names need to know
        self.scripts: ScriptBatcher | ClusterScripts = (
            ClusterScripts(redis, sources) if self.cluster else ScriptBatcher(redis, sources)
        )
        self._setup()

    def _setup(self) -> None:
        """Where a part of the store sets up its own state (each calls ``super()._setup()``)."""
        # told of each touch this process records (proxy/known.py keeps last activity)
        self.on_touched: Callable[[str, str, float], None] | None = None

    # --- keys ---------------------------------------------------------------------------------
    def _t(self, tenant: str) -> str:
        """The tenant as written in key names: a hash tag on a cluster (``{tenant}``), so every
        key of a tenant lies in one slot and each script touches one node."""
        return f"{{{tenant}}}" if self.cluster else tenant

    def key(self, kind: str, tenant: str, sid: str) -> str:
        return f"{self.ns}:{kind}:{self._t(tenant)}:{sid}"

    def index_key(self, tenant: str) -> str:
        return f"{self.ns}:idx:{self._t(tenant)}"

    def dl_key(self, tenant: str) -> str:
        """The deadline ZSET holding ``tenant``'s sessions: one for all on a single Redis, one
        per tenant on a cluster."""
        return f"{self.ns}:dl:{self._t(tenant)}" if self.cluster else self.deadlines_key

    def feed_keys(self, tenant: str) -> list[str]:
        """The change feed ZSET and its sequence holding ``tenant``'s sessions."""
        if self.cluster:
            return [f"{self.ns}:chg:{self._t(tenant)}", f"{self.ns}:chgseq:{self._t(tenant)}"]
        return [self.feed_key, self.feed_seq_key]

    def _none(self, tenant: str) -> str:
        """A key a script is given and does not use (no parent): "" on a single Redis, a key of
        the tenant's slot on a cluster (a client routes a call by all its keys)."""
        return f"{self.ns}:none:{self._t(tenant)}" if self.cluster else ""

    @property
    def deadlines_key(self) -> str:
        return f"{self.ns}:dl"

    @property
    def feed_key(self) -> str:
        """ZSET: deadline members of changed protected sessions, by change sequence."""
        return f"{self.ns}:chg"

    @property
    def feed_seq_key(self) -> str:
        return f"{self.ns}:chgseq"

    @property
    def tenants_key(self) -> str:
        return f"{self.ns}:tenants"

    # --- failure handling ---------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    @property
    def answering(self) -> bool:
        """Whether Redis may be taken to accept a known session's repeat without asking: no
        recent failure, and the script connection open and not closed by Redis (a single
        Redis or Sentinel's master; never on a cluster, whose calls go to several nodes)."""
        now = time.monotonic()
        if now - self._answered_at < ANSWERING_FOR_S:  # checked a moment ago (no failure since)
            return True
        scripts = self.scripts
        ok = now >= self._down_until and isinstance(scripts, ScriptBatcher) and scripts.connected
        if ok:
            self._answered_at = now
        return ok

    def _stalled(self, exc: Exception, started: float) -> bool:
        """A timeout that fired at twice its time or later: this process's event loop was
        blocked (the timer ran late, and before the reply that may have come in time), so it
        says nothing of Redis. A Redis that is hung times out at about ``timeout_s``."""
        timeout = self._timeout_s
        return (
            isinstance(exc, redis_errors.TimeoutError)
            and timeout is not None
            and time.monotonic() - started > STALL_FACTOR * timeout
        )

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        if not self.available:
            raise StoreDown("redis unavailable (cooling down after an error)")
        started = time.monotonic()
        try:
            return await op()
        # InvalidResponse: the URL names something that is not Redis (an HTTP port ...)
        except (
            redis_errors.ConnectionError,
            redis_errors.TimeoutError,
            redis_errors.InvalidResponse,
            redis_errors.ClusterError,  # no node serves the slot (yet), the cluster is down
            redis_errors.ReadOnlyError,  # a former master, demoted
            OSError,
        ) as exc:
            if self._stalled(exc, started):  # this call fails open; the next ones are not held
                if self._on_stall is not None:
                    self._on_stall()
                raise StoreDown(f"redis call late after an event-loop stall: {exc}") from exc
            self._down_until = time.monotonic() + self._cooldown_s
            self._answered_at = -1e9
            if self._on_error is not None:
                self._on_error()
            raise StoreDown(f"redis unavailable: {exc}") from exc

    async def aclose(self) -> None:
        """Close the script connection; the Redis client itself belongs to the caller."""
        await self.scripts.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self._call(lambda: self.redis.ping()))
        except StoreDown:
            return False

    async def tenants(self) -> list[str]:
        raw = await self._call(lambda: self.redis.smembers(self.tenants_key))
        return sorted(as_text(t) for t in raw)

    def _member(self, tenant: str, sid: str) -> str:
        return f"{tenant}{SEP}{sid}"
