"""The session plane: per-tenant sessions, parent/child trees and TTL deadlines in Redis.

:class:`SessionStore` composes the parts: key layout and failure handling
(``store_base``), the protected-session mirror (``store_mirror``), and the pin ledgers and leases
(``store_pins``), the hot-path writes (``store_writes``); the session records are in ``store_model``.
"""

from __future__ import annotations

import bisect
from typing import Any

from proxy.store_base import StoreBase
from proxy.store_mirror import FEED_MAX, FEED_PAGE, LOAD_PAGE, ProtectedMirror
from proxy.store_model import (
    BRIEF,
    SEP,
    STATES,
    Session,
    StoreDown,
    StoreRejected,
    Upserted,
    Usage,
    as_text,
    decode_session,
)
from proxy.store_pins import PinLedger
from proxy.store_writes import SessionWrites

__all__ = [
    "BRIEF",
    "FEED_MAX",
    "FEED_PAGE",
    "LOAD_PAGE",
    "SEP",
    "STATES",
    "Session",
    "SessionStore",
    "StoreBase",
    "StoreDown",
    "StoreRejected",
    "Upserted",
    "Usage",
]


class SessionStore(SessionWrites, ProtectedMirror, PinLedger):
    """All Redis access for sessions. One instance per app, shared by handlers and workers."""

    async def get(self, tenant: str, sid: str) -> Session | None:
        async def op() -> Session | None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.key("s", tenant, sid))
                pipe.smembers(self.key("ch", tenant, sid))
                pipe.strlen(self.key("ctx", tenant, sid))
                raw, children, ctx_len = await pipe.execute()
            return decode_session(tenant, raw, list(children), int(ctx_len)) if raw else None

        return await self._call(op)

    async def get_context(self, tenant: str, sid: str) -> bytes | None:
        value = await self._call(lambda: self.redis.get(self.key("ctx", tenant, sid)))
        return value if isinstance(value, bytes) else None

    async def list_sessions(
        self,
        tenant: str,
        *,
        parent: str | None = None,
        state: str | None = None,
        after: str = "",
        limit: int = 50,
    ) -> tuple[list[Session], str | None]:
        """One page of a tenant's sessions by id, those after ``after`` (a keyset: ids do not
        move when a session is used, unlike its place in the activity index). Returns (page,
        the last id examined when more remain, else None)."""
        raw: Any
        if parent is not None:
            raw = await self._call(lambda: self.redis.smembers(self.key("ch", tenant, parent)))
        else:
            raw = await self._call(lambda: self.redis.zrange(self.index_key(tenant), 0, -1))
        ids = sorted(as_text(i) for i in raw)
        page: list[Session] = []
        pos = bisect.bisect_right(ids, after) if after else 0
        while pos < len(ids) and len(page) < limit:
            batch = ids[pos : pos + max(limit, 64)]
            sessions = await self.get_many(tenant, batch)
            for sess in sessions:
                pos += 1
                if sess is not None and (state is None or sess.state == state):
                    page.append(sess)
                    if len(page) == limit:
                        break
        return page, (ids[pos - 1] if pos < len(ids) else None)

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
                out.append(
                    decode_session(tenant, raw, list(children), int(ctx_len)) if raw else None
                )
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
        pairs = (as_text(m).split(SEP, 1) for m in raw)
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
        recorded = bool(await self._call(lambda: self.scripts.call("touched", keys, args)))
        if recorded and self.on_touched is not None:
            self.on_touched(tenant, sid, now)
        return recorded

    async def protect(
        self,
        tenant: str,
        sid: str,
        now: float,
        ttl_s: float,
        *,
        state: str = "",
        forget_engine: bool = False,
        guessed: bool = False,
    ) -> bool:
        """Set (ttl > 0) or drop (ttl == 0) protection, optionally the state; False if unknown.
        ``guessed``: kvkeeper's guess (``policy/returns.py``), ranked after a client's TTL."""
        keys = [self.key("s", tenant, sid), self.dl_key(tenant), *self.feed_keys(tenant)]
        args: list[str | int] = [
            repr(now),
            repr(ttl_s),
            state,
            self._member(tenant, sid),
            "1" if forget_engine else "0",
            "1" if guessed else "0",
        ]
        return bool(await self._call(lambda: self.scripts.call("protect", keys, args)))

    async def set_blocks(self, tenant: str, sid: str, blocks: bytes) -> None:
        """The session's block-hash list (packed 8-byte ints), for residency lookups."""
        key = self.key("blk", tenant, sid)
        await self._call(lambda: self.redis.set(key, blocks, ex=self.limits.idle_expiry_s))

    async def get_blocks(self, tenant: str, sid: str) -> bytes | None:
        value = await self._call(lambda: self.redis.get(self.key("blk", tenant, sid)))
        return value if isinstance(value, bytes) else None
