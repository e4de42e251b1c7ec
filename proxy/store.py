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

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from proxy.batching import ClusterScripts, ScriptBatcher
from proxy.hints import Hint
from proxy.settings import Limits

T = TypeVar("T")
SEP = "\x1f"
STATES = ("active", "protected", "idle", "offloaded")


class StoreDown(Exception):
    """Redis is unreachable; the data plane fails open, admin answers 503."""


class StoreRejected(Exception):
    """A bound refused the hint (max_sessions, max_children, parent_mismatch)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Upserted:
    created: bool
    engine: str | None
    parent_engine: str | None
    last_active: float = 0.0  # before this request: when the prefix was last used or touched
    last_prompt_tokens: int = 0  # before this request


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Session:
    """A session as stored, decoded."""

    tenant: str
    session_id: str
    state: str
    created: float
    last_seen: float
    parent: str | None = None
    agent: str | None = None
    engine: str | None = None
    ttl: float = 0.0
    ttl_until: float = 0.0
    retention: str = "default"
    counters: dict[str, int] = field(default_factory=dict)
    children: tuple[str, ...] = ()
    context_bytes: int = 0
    last_used: float = 0.0
    last_touch: float = 0.0
    last_prompt_tokens: int = 0

    @property
    def last_active(self) -> float:
        """When its prefix was last used by a request or refreshed by a touch."""
        return max(self.last_used, self.last_touch, self.last_seen)

    def ttl_left(self, now: float) -> float:
        return max(0.0, self.ttl_until - now)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "tenant": self.tenant,
            "state": self.state,
            "parent_session_id": self.parent,
            "children": list(self.children),
            "agent": self.agent,
            "engine": self.engine,
            "created": self.created,
            "last_seen": self.last_seen,
            "ttl_s": self.ttl,
            "ttl_left_s": round(self.ttl_left(now), 3),
            "retention": self.retention,
            "counters": self.counters,
            "context_bytes": self.context_bytes,
            "last_used": self.last_used or None,
            "last_touch": self.last_touch or None,
        }


_COUNTERS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "touches",
    "touch_tokens",
    "warmups",
    "warmup_tokens",
    "expiries",
)
# what the retention worker needs of a protected session each tick
_BRIEF = (
    "session_id",
    "state",
    "engine",
    "ttl",
    "ttl_until",
    "created",
    "last_seen",
    "last_used",
    "last_touch",
    "parent",
    "last_prompt_tokens",
)
# claim a long-retention pin (proxy/longterm.py): KEYS deadlines, pins; ARGV member, before|''
_CLAIM_LONG_PIN = """
local due = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not due then return false end
if ARGV[2] ~= '' and tonumber(due) > tonumber(ARGV[2]) then return false end
local payload = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return payload or false
"""
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
FEED_PAGE = 2000  # changed sessions read per call (a tick reads at most this many)
FEED_MAX = 500_000  # feed entries kept (one per session changed); older ones trimmed
LOAD_PAGE = 1000  # protected sessions per call when the mirror is (re)loaded


def _decode(tenant: str, raw: dict[bytes, bytes], children: list[bytes], ctx_len: int) -> Session:
    d = {k.decode(): v.decode() for k, v in raw.items()}
    return Session(
        tenant=tenant,
        session_id=d["session_id"],
        state=d.get("state", "idle"),
        created=float(d.get("created", 0)),
        last_seen=float(d.get("last_seen", d.get("created", 0))),
        parent=d.get("parent"),
        agent=d.get("agent"),
        engine=d.get("engine") or None,
        ttl=float(d.get("ttl", 0)),
        ttl_until=float(d.get("ttl_until", 0)),
        retention=d.get("retention", "default"),
        counters={k: int(d.get(k, 0)) for k in _COUNTERS},
        children=tuple(sorted(c.decode() for c in children)),
        context_bytes=ctx_len,
        last_used=float(d.get("last_used", 0)),
        last_touch=float(d.get("last_touch", 0)),
        last_prompt_tokens=int(d.get("last_prompt_tokens", 0)),
    )


def _brief(row: Sequence[Any]) -> Session:
    """A session from ``protected.lua``'s row: tenant, then the ``_BRIEF`` fields in order."""
    tenant, sid, state, engine, ttl, ttl_until, created, seen, used, touch, parent, lpt = row
    return Session(
        tenant=tenant.decode(),
        session_id=sid.decode(),
        state=state.decode() if state else "idle",
        created=float(created or 0),
        last_seen=float(seen or created or 0),
        parent=parent.decode() if parent else None,
        engine=engine.decode() if engine else None,
        ttl=float(ttl or 0),
        ttl_until=float(ttl_until or 0),
        last_used=float(used or 0),
        last_touch=float(touch or 0),
        last_prompt_tokens=int(lpt or 0),
    )


def _text(value: Any) -> str:
    """Redis replies are bytes; decode one whatever the client's typing says."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _script(name: str) -> str:
    return resources.files("proxy").joinpath("lua", name).read_text()


class SessionStore:
    """All Redis access for sessions. One instance per app, shared by handlers and workers."""

    def __init__(
        self,
        redis: Redis,
        limits: Limits,
        *,
        namespace: str = "kvk",
        cooldown_s: float = 1.0,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.redis = redis
        self.limits = limits
        self.ns = namespace
        self._cooldown_s = cooldown_s
        self._down_until = 0.0
        self._on_error = on_error
        # protected(): the protected sessions as last read, and the feed sequence read up to
        self._mirror: dict[tuple[str, str], Session] = {}
        self._cursors: dict[str, int] = {}  # per feed ("" on a single Redis, else tenant)
        self._tenant_list: list[str] = []
        self._tenants_at = -1e9
        self._known_tenants: set[str] = set()
        self._mirror_lock = asyncio.Lock()
        # a heap of (deadline, tie-break, key, session): the mirror's expiries in order
        self._deadlines: list[tuple[float, int, tuple[str, str], Session]] = []
        self._order = itertools.count()
        self._listed: list[Session] | None = None  # the answer, until the mirror changes
        self.mirror_loads = 0  # full (re)loads, for tests and benchmarks
        sources = {name: _script(f"{name}.lua") for name in _SCRIPTS}
        # a Redis Cluster: keys hash-tagged per tenant, each script call routed by its slot
        self.cluster = isinstance(redis, RedisCluster)
        self._tag = "1" if self.cluster else "0"  # scripts that derive key names need to know
        self.scripts: ScriptBatcher | ClusterScripts = (
            ClusterScripts(redis, sources) if self.cluster else ScriptBatcher(redis, sources)
        )

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

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        if not self.available:
            raise StoreDown("redis unavailable (cooling down after an error)")
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
            self._down_until = time.monotonic() + self._cooldown_s
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

    # --- hot path -----------------------------------------------------------------------------
    async def upsert(self, tenant: str, hint: Hint, now: float) -> Upserted:
        """Create or refresh the hint's session (one round trip). Raises StoreRejected/StoreDown."""
        sid, parent = hint.session_id, hint.parent_session_id or ""
        keys = [
            self.key("s", tenant, sid),
            self.index_key(tenant),
            self.dl_key(tenant),
            self.key("s", tenant, parent) if parent else self._none(tenant),
            self.key("ch", tenant, parent) if parent else self._none(tenant),
            # the tenants SET is one key for all: on a cluster it is added to after the call
            f"{self.ns}:tn:{self._t(tenant)}" if self.cluster else self.tenants_key,
            self.key("ch", tenant, sid),
            self.key("ctx", tenant, sid),
            *self.feed_keys(tenant),
        ]
        args: list[str | int] = [
            repr(now),
            sid,
            tenant,
            parent,
            hint.agent_name or "",
            "" if hint.ttl_s is None else repr(hint.ttl_s),
            hint.retention,
            self.limits.max_sessions_per_tenant,
            self.limits.max_children,
            self.limits.idle_expiry_s,
            f"{tenant}{SEP}{sid}",
            repr(now - self.limits.idle_expiry_s),
        ]
        reply = await self._call(lambda: self.scripts.call("upsert", keys, args))
        if reply[0] != b"ok":
            raise StoreRejected(_text(reply[0]))
        _, created, engine, parent_engine, last_active, last_prompt = reply
        if self.cluster and (created or tenant not in self._known_tenants):
            await self._call(lambda: self.redis.sadd(self.tenants_key, tenant))
            self._known_tenants.add(tenant)
        return Upserted(
            bool(created),
            _text(engine) or None,
            _text(parent_engine) or None,
            float(_text(last_active)),
            int(_text(last_prompt)),
        )

    async def unregister(self, tenant: str, hint: Hint, now: float) -> bool:
        """Undo the session ``upsert`` created for a request that then failed upstream; False
        when another request has used it since (it is kept, and no longer ``active``)."""
        sid, parent = hint.session_id, hint.parent_session_id or ""
        keys = [
            self.key("s", tenant, sid),
            self.index_key(tenant),
            self.dl_key(tenant),
            self.key("ch", tenant, sid),
            self.key("ctx", tenant, sid),
            self.key("ch", tenant, parent) if parent else self._none(tenant),
            *self.feed_keys(tenant),
        ]
        args: list[str | int | float] = [sid, f"{tenant}{SEP}{sid}", now]
        return bool(await self._call(lambda: self.scripts.call("unregister", keys, args)))

    async def record_completions(
        self, records: list[tuple[str, str, float, str, Usage, Usage, bytes]]
    ) -> int:
        """Write finished requests, merged per session, in one script call (off the hot path;
        one per tenant on a cluster, where a call touches one slot).

        A record is (tenant, sid, now, engine, last request's usage, summed usage, context blob
        or b""). Returns how many sessions still existed.
        """
        if not self.cluster:
            return await self._complete(records, self.feed_keys(""))
        by_tenant: dict[str, list[tuple[str, str, float, str, Usage, Usage, bytes]]] = {}
        for record in records:
            by_tenant.setdefault(record[0], []).append(record)
        written = 0
        for tenant, group in by_tenant.items():
            written += await self._complete(group, self.feed_keys(tenant))
        return written

    async def _complete(
        self, records: list[tuple[str, str, float, str, Usage, Usage, bytes]], feed: list[str]
    ) -> int:
        keys: list[str] = list(feed)
        args: list[bytes | str | int | float] = [self.limits.idle_expiry_s]
        for tenant, sid, now, engine, last, total, context in records:
            keys += [
                self.key("s", tenant, sid),
                self.key("ctx", tenant, sid),
                self.index_key(tenant),
            ]
            args += [
                repr(now),
                engine,
                last.prompt_tokens,
                last.cached_tokens,
                total.prompt_tokens,
                total.cached_tokens,
                total.completion_tokens,
                context,
                sid,
                self._member(tenant, sid),
            ]
        return int(await self._call(lambda: self.scripts.call("complete", keys, args)))

    # --- reads ----------------------------------------------------------------------------------
    async def get(self, tenant: str, sid: str) -> Session | None:
        async def op() -> Session | None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.key("s", tenant, sid))
                pipe.smembers(self.key("ch", tenant, sid))
                pipe.strlen(self.key("ctx", tenant, sid))
                raw, children, ctx_len = await pipe.execute()
            return _decode(tenant, raw, list(children), int(ctx_len)) if raw else None

        return await self._call(op)

    async def get_context(self, tenant: str, sid: str) -> bytes | None:
        value = await self._call(lambda: self.redis.get(self.key("ctx", tenant, sid)))
        return value if isinstance(value, bytes) else None

    async def tenants(self) -> list[str]:
        raw = await self._call(lambda: self.redis.smembers(self.tenants_key))
        return sorted(_text(t) for t in raw)

    async def list_sessions(
        self,
        tenant: str,
        *,
        parent: str | None = None,
        state: str | None = None,
        offset: int = 0,
        limit: int = 50,
    ) -> tuple[list[Session], int | None]:
        """One page of a tenant's sessions, newest first; returns (page, next offset or None)."""
        if parent is not None:
            ids_raw = await self._call(lambda: self.redis.smembers(self.key("ch", tenant, parent)))
            ids = sorted(_text(i) for i in ids_raw)
        else:
            ids_b = await self._call(lambda: self.redis.zrevrange(self.index_key(tenant), 0, -1))
            ids = [_text(i) for i in ids_b]
        page: list[Session] = []
        pos = offset
        while pos < len(ids) and len(page) < limit:
            batch = ids[pos : pos + max(limit, 64)]
            sessions = await self.get_many(tenant, batch)
            for sess in sessions:
                pos += 1
                if sess is not None and (state is None or sess.state == state):
                    page.append(sess)
                    if len(page) == limit:
                        break
        return page, (pos if pos < len(ids) else None)

    async def exist(self, sessions: list[tuple[str, str]]) -> list[bool]:
        """Whether each (tenant, session id) still has its record (one round trip)."""

        async def op() -> list[bool]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for tenant, sid in sessions:
                    pipe.exists(self.key("s", tenant, sid))
                return [bool(n) for n in await pipe.execute()]

        return await self._call(op)

    async def get_many(self, tenant: str, ids: list[str]) -> list[Session | None]:
        async def op() -> list[Session | None]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid in ids:
                    pipe.hgetall(self.key("s", tenant, sid))
                    pipe.smembers(self.key("ch", tenant, sid))
                    pipe.strlen(self.key("ctx", tenant, sid))
                res = await pipe.execute()
            out: list[Session | None] = []
            for i in range(len(ids)):
                raw, children, ctx_len = res[3 * i : 3 * i + 3]
                out.append(_decode(tenant, raw, list(children), int(ctx_len)) if raw else None)
            return out

        return await self._call(op)

    # --- frees ----------------------------------------------------------------------------------
    async def free(self, tenant: str, sid: str, *, tree: bool = False) -> list[str]:
        """Free one session (children detached) or its tree (children first). [] if not found."""
        keys = [self.index_key(tenant), self.dl_key(tenant), *self.feed_keys(tenant)]
        args: list[str | int] = [
            self.ns,
            tenant,
            sid,
            "1" if tree else "0",
            100_000,
            self._t(tenant),
        ]
        freed = await self._call(lambda: self.scripts.call("free", keys, args))
        return [s.decode() for s in freed]

    async def due(self, now: float, limit: int = 512) -> list[tuple[str, str]]:
        """(tenant, sid) pairs whose TTL deadline has passed."""
        raw: list[Any] = []
        for key in await self._dl_shards():
            raw += await self._due_in(key, now, limit)
        pairs = (_text(m).split(SEP, 1) for m in raw)
        return [(p[0], p[1]) for p in pairs if len(p) == 2]

    async def _due_in(self, key: str, now: float, limit: int) -> list[Any]:
        return list(
            await self._call(lambda: self.redis.zrangebyscore(key, "-inf", now, start=0, num=limit))
        )

    async def _dl_shards(self) -> list[str]:
        """Every deadline ZSET: the one of a single Redis, each tenant's on a cluster."""
        if not self.cluster:
            return [self.deadlines_key]
        return [self.dl_key(t) for t in await self.tenants()]

    # --- retention ------------------------------------------------------------------------------
    def _member(self, tenant: str, sid: str) -> str:
        return f"{tenant}{SEP}{sid}"

    async def expire(self, tenant: str, sid: str, now: float) -> bool:
        """Expire the session's TTL if its deadline passed; True when this call did it."""
        keys = [self.key("s", tenant, sid), self.dl_key(tenant), *self.feed_keys(tenant)]
        args: list[str | int] = [repr(now), self._member(tenant, sid)]
        return bool(await self._call(lambda: self.scripts.call("expire", keys, args)))

    async def touched(
        self, tenant: str, sid: str, now: float, recomputed: int, *, warmup: bool = False
    ) -> bool:
        keys = [self.key("s", tenant, sid), *self.feed_keys(tenant)]
        args: list[str | int] = [
            repr(now),
            "warmup" if warmup else "touch",
            recomputed,
            self._member(tenant, sid),
        ]
        return bool(await self._call(lambda: self.scripts.call("touched", keys, args)))

    async def protect(
        self,
        tenant: str,
        sid: str,
        now: float,
        ttl_s: float,
        *,
        state: str = "",
        forget_engine: bool = False,
    ) -> bool:
        """Set (ttl > 0) or drop (ttl == 0) protection, optionally the state; False if unknown."""
        keys = [self.key("s", tenant, sid), self.dl_key(tenant), *self.feed_keys(tenant)]
        args: list[str | int] = [
            repr(now),
            repr(ttl_s),
            state,
            self._member(tenant, sid),
            "1" if forget_engine else "0",
        ]
        return bool(await self._call(lambda: self.scripts.call("protect", keys, args)))

    # --- the offload tier's pin ledger (proxy/tiers.py) ----------------------------------------
    def tier_pins_key(self, engine: str) -> str:
        return f"{self.ns}:tierpins:{engine}"

    async def save_tier_pin(self, engine: str, tenant: str, sid: str, payload: bytes) -> None:
        """Record a pin kvkeeper holds on ``engine``'s tier (what the next leader must undo)."""
        key, member = self.tier_pins_key(engine), self._member(tenant, sid)
        await self._call(lambda: self.redis.hset(key, member, payload))

    async def drop_tier_pin(self, engine: str, tenant: str, sid: str) -> None:
        key, member = self.tier_pins_key(engine), self._member(tenant, sid)
        await self._call(lambda: self.redis.hdel(key, member))

    async def tier_pins(self, engine: str) -> dict[tuple[str, str], bytes]:
        """Every pin recorded on ``engine``'s tier, by (tenant, session id)."""
        key = self.tier_pins_key(engine)
        raw = await self._call(lambda: self.redis.hgetall(key))
        out: dict[tuple[str, str], bytes] = {}
        for member, payload in raw.items():  # bytes: the client does not decode responses
            tenant, _, sid = _text(member).partition(SEP)
            out[(tenant, sid)] = payload if isinstance(payload, bytes) else payload.encode()
        return out

    # --- retention beyond the GPU cap, pinned in the offload tier (proxy/longterm.py) ----------
    @property
    def long_deadlines_key(self) -> str:
        return f"{self.ns}:long:dl" + (":{long}" if self.cluster else "")

    @property
    def long_pins_key(self) -> str:
        return f"{self.ns}:long:pins" + (":{long}" if self.cluster else "")

    async def save_long_pin(self, tenant: str, sid: str, until: float, payload: bytes) -> None:
        """Record a long-retention pin and its deadline (replacing the session's previous one)."""
        member = self._member(tenant, sid)

        async def op() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.long_pins_key, member, payload)
                pipe.zadd(self.long_deadlines_key, {member: until})
                await pipe.execute()

        await self._call(op)

    async def long_pin(self, tenant: str, sid: str) -> tuple[float, bytes] | None:
        """(deadline, payload) of the session's long-retention pin, if it has one."""
        member = self._member(tenant, sid)

        async def op() -> tuple[float, bytes] | None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zscore(self.long_deadlines_key, member)
                pipe.hget(self.long_pins_key, member)
                until, payload = await pipe.execute()
            if until is None or payload is None:
                return None
            return float(until), payload if isinstance(payload, bytes) else payload.encode()

        return await self._call(op)

    async def long_pins_due(self, now: float, limit: int = 256) -> list[tuple[str, str]]:
        """(tenant, sid) of long-retention pins whose deadline has passed."""
        raw = await self._call(
            lambda: self.redis.zrangebyscore(
                self.long_deadlines_key, "-inf", now, start=0, num=limit
            )
        )
        pairs = (_text(m).split(SEP, 1) for m in raw)
        return [(p[0], p[1]) for p in pairs if len(p) == 2]

    async def claim_long_pin(
        self, tenant: str, sid: str, before: float | None = None
    ) -> bytes | None:
        """Take the session's long-retention pin off the ledger (with ``before``: only if its
        deadline has passed by then); its payload when this call took it, so exactly one
        replica releases each pin."""
        keys = [self.long_deadlines_key, self.long_pins_key]
        args = [self._member(tenant, sid), "" if before is None else repr(before)]
        raw = await self._call(lambda: self.redis.eval(_CLAIM_LONG_PIN, 2, *keys, *args))
        if not raw:
            return None
        return raw if isinstance(raw, bytes) else str(raw).encode()

    async def lease(self, name: str, holder: str, ttl_ms: int) -> int:
        """Acquire/renew the lease ``name``: the fencing token while held, else 0."""
        tag = f"{{{name}}}" if self.cluster else name  # both keys in one slot
        keys = [f"{self.ns}:lease:{tag}", f"{self.ns}:fence:{tag}"]
        args: list[str | int] = [holder, ttl_ms]
        return int(await self._call(lambda: self.scripts.call("lease", keys, args)))

    async def release_lease(self, name: str, holder: str) -> None:
        key = f"{self.ns}:lease:" + (f"{{{name}}}" if self.cluster else name)
        current = await self._call(lambda: self.redis.get(key))
        if current is not None and _text(current).rsplit("|", 1)[0] == holder:
            await self._call(lambda: self.redis.delete(key))

    async def protected(self, now: float) -> list[Session]:
        """Every session whose TTL deadline is still ahead, across tenants.

        Answered from a mirror this store keeps in step with Redis: loaded once page by page
        (``protected.lua``), then brought up to date by reading only the sessions changed since
        the last call (``feed.lua``, at most ``FEED_PAGE`` per call). Redis' work per call
        follows the changes, not the number of protected sessions (every retention worker of
        every replica asked for all of them twice a second, ~1 s of Redis time per call at 10K).
        Reloaded when the feed shows a gap (Redis lost data, or this replica fell behind the
        trimmed part). Callers share one refresh.
        """
        async with self._mirror_lock:
            await self._refresh()
        heap, mirror = self._deadlines, self._mirror
        while heap and heap[0][0] <= now:  # deadlines passed: a new one comes back by the feed
            _, _, key, session = heapq.heappop(heap)
            if mirror.get(key) is session:
                del mirror[key]
                self._listed = None
        if self._listed is None:
            self._listed = list(mirror.values())
        return self._listed

    def _mirror_set(self, key: tuple[str, str], session: Session | None) -> None:
        """Record a session read from Redis (None: gone) in the mirror."""
        self._listed = None
        if session is None:
            self._mirror.pop(key, None)
            return
        self._mirror[key] = session
        heapq.heappush(self._deadlines, (session.ttl_until, next(self._order), key, session))
        if len(self._deadlines) > 2 * len(self._mirror) + 1024:  # entries of replaced rows
            self._heapify()

    def _heapify(self) -> None:
        self._deadlines = [(s.ttl_until, next(self._order), k, s) for k, s in self._mirror.items()]
        heapq.heapify(self._deadlines)

    async def _refresh(self) -> None:
        shards = await self._tenants_cached() if self.cluster else [""]
        for shard in shards:
            await self._refresh_shard(shard)

    async def _tenants_cached(self) -> list[str]:
        """The tenants (a cluster's feeds are per tenant); re-read at most once a second."""
        if time.monotonic() - self._tenants_at > 1.0:
            self._tenant_list = await self.tenants()
            self._tenants_at = time.monotonic()
        if not self._known_tenants.issubset(self._tenant_list):  # added here since: at once
            self._tenant_list = sorted(self._known_tenants.union(self._tenant_list))
        return self._tenant_list

    async def _refresh_shard(self, shard: str) -> None:
        cursor = self._cursors.get(shard)
        reply = await self._feed(shard, -1 if cursor is None else cursor)
        seq, floor = int(reply[0]), int(reply[1])
        if cursor is None or seq < cursor or cursor < floor:
            await self._load(shard, seq)
            return
        width = 2 + len(_BRIEF)
        rows = reply[2:]
        for i in range(0, len(rows), width):
            member, score, *fields = rows[i : i + width]
            tenant, _, sid = _text(member).partition(SEP)
            gone = fields[0] is None  # freed, or no longer there
            self._mirror_set((tenant, sid), None if gone else _brief((tenant.encode(), *fields)))
            cursor = max(cursor, int(score))
            if i % (128 * width) == 128 * width - width:
                await asyncio.sleep(0)  # many changes: the data plane runs in between
        if len(rows) < FEED_PAGE * width:
            cursor = max(cursor, seq)  # read everything up to seq
        self._cursors[shard] = cursor

    async def _feed(self, shard: str, after: int) -> list[Any]:
        feed, seq = self.feed_keys(shard)
        floor = f"{self.ns}:chgfloor:{self._t(shard)}" if self.cluster else f"{self.ns}:chgfloor"
        args: list[str | int] = [after, FEED_PAGE, FEED_MAX, self.ns, self._tag, *_BRIEF]
        return list(await self._call(lambda: self.scripts.call("feed", [feed, seq, floor], args)))

    async def _page(self, shard: str, now: float, offset: int) -> list[Any]:
        args: list[str | int] = [repr(now), LOAD_PAGE, self.ns, offset, self._tag, *_BRIEF]
        keys = [self.dl_key(shard)]
        return list(await self._call(lambda: self.scripts.call("protected", keys, args)))

    async def _load(self, shard: str, seq: int) -> None:
        """(Re)load one shard of the mirror (all of it on a single Redis, one tenant's on a
        cluster) page by page; changes made meanwhile come after ``seq``."""
        found: dict[tuple[str, str], Session] = {}
        width, offset, now = 1 + len(_BRIEF), 0, time.time()
        while True:
            flat = await self._page(shard, now, offset)
            for i in range(0, len(flat), width):
                session = _brief(flat[i : i + width])
                found[(session.tenant, session.session_id)] = session
            if len(flat) < LOAD_PAGE * width:
                break
            offset += LOAD_PAGE
            await asyncio.sleep(0)
        if self.cluster:
            mirror = {k: v for k, v in self._mirror.items() if k[0] != shard}
            mirror.update(found)
        else:
            mirror = found
        self._mirror, self._cursors[shard] = mirror, seq
        self._heapify()
        self._listed = None
        self.mirror_loads += 1

    async def set_blocks(self, tenant: str, sid: str, blocks: bytes) -> None:
        """The session's block-hash list (packed 8-byte ints), for residency lookups."""
        key = self.key("blk", tenant, sid)
        await self._call(lambda: self.redis.set(key, blocks, ex=self.limits.idle_expiry_s))

    async def get_blocks(self, tenant: str, sid: str) -> bytes | None:
        value = await self._call(lambda: self.redis.get(self.key("blk", tenant, sid)))
        return value if isinstance(value, bytes) else None
