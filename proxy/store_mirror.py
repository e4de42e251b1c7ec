"""The mirror of protected sessions: loaded once from Redis, then kept in step by the change
feed, so a retention tick's Redis work follows the changes, not the number of sessions."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any

from proxy.store_base import StoreBase
from proxy.store_model import BRIEF, SEP, Session, as_text, brief_session

FEED_PAGE = 2000  # changed sessions read per call (a tick reads at most this many)
FEED_MAX = 500_000  # feed entries kept (one per session changed); older ones trimmed
LOAD_PAGE = 1000  # protected sessions per call when the mirror is (re)loaded
CHANGE_LOG_MAX = 200_000  # mirror changes kept for changed_since() readers


class ProtectedMirror(StoreBase):
    """``protected()``: every session whose TTL deadline is still ahead, from the mirror."""

    def _setup(self) -> None:
        super()._setup()
        # protected(): the protected sessions as last read, and the feed sequence read up to
        self._mirror: dict[tuple[str, str], Session] = {}
        self._cursors: dict[str, int] = {}  # per feed ("" on a single Redis, else tenant)
        self._tenant_list: list[str] = []
        self._tenants_at = -1e9
        self._mirror_lock = asyncio.Lock()
        # a heap of (deadline, tie-break, key, session): the mirror's expiries in order
        self._deadlines: list[tuple[float, int, tuple[str, str], Session]] = []
        self._order = itertools.count()
        self._listed: list[Session] | None = None  # the answer, until the mirror changes
        self.mirror_loads = 0  # full (re)loads, for tests and benchmarks
        # keys changed in the mirror, in order, so a reader can follow it without a full walk:
        # entry i of the log is change number ``_log_base + i``
        self._log: list[tuple[str, str]] = []
        self._log_base = 0

    async def protected(self, now: float) -> list[Session]:
        """Every session whose TTL deadline is still ahead, across tenants.

        Answered from a mirror this store keeps in step with Redis: loaded once page by page
        (``protected.lua``), then brought up to date by reading only the sessions changed since
        the last call (``feed.lua``, at most ``FEED_PAGE`` per call). Redis' work per call
        follows the changes, not the number of protected sessions (every retention worker of
        every replica asks twice a second).
        Reloaded when the feed shows a gap (Redis lost data, or this replica fell behind the
        trimmed part). Callers share one refresh.
        """
        await self.refresh_protected(now)
        if self._listed is None:
            self._listed = list(self._mirror.values())
        return self._listed

    async def refresh_protected(self, now: float) -> None:
        """Bring the mirror up to date as ``protected()`` does, without listing it (readers of
        ``changed_since``)."""
        async with self._mirror_lock:
            await self._refresh()
        heap, mirror = self._deadlines, self._mirror
        while heap and heap[0][0] <= now:  # deadlines passed: a new one comes back by the feed
            _, _, key, session = heapq.heappop(heap)
            if mirror.get(key) is session:
                del mirror[key]
                self._listed = None
                self._log.append(key)

    def changed_since(self, mark: int) -> tuple[int, list[tuple[str, str]] | None]:
        """The keys the mirror changed (set, replaced or dropped) since ``mark`` (a value this
        returned before), and the new mark; None instead of keys: start over from
        ``mirrored_all()`` (first call, a reload, or too far behind). Call after
        ``refresh_protected()`` (or ``protected()``)."""
        end = self._log_base + len(self._log)
        if mark < self._log_base:
            return end, None
        return end, self._log[mark - self._log_base :]

    def mirrored_all(self) -> list[Session]:
        """Every session the mirror holds (after ``refresh_protected``)."""
        return list(self._mirror.values())

    def mirrored(self, key: tuple[str, str]) -> Session | None:
        """The protected session ``key`` as the mirror holds it (None: not protected)."""
        return self._mirror.get(key)

    def _mirror_set(self, key: tuple[str, str], session: Session | None) -> None:
        """Record a session read from Redis (None: gone) in the mirror."""
        self._listed = None
        self._log.append(key)
        if len(self._log) > CHANGE_LOG_MAX:  # readers that far behind start over
            self._log_base += len(self._log)
            self._log = []
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
        width = 2 + len(BRIEF)
        rows = reply[2:]
        for i in range(0, len(rows), width):
            member, score, *fields = rows[i : i + width]
            tenant, _, sid = as_text(member).partition(SEP)
            gone = fields[0] is None  # freed, or no longer there
            self._mirror_set(
                (tenant, sid), None if gone else brief_session((tenant.encode(), *fields))
            )
            cursor = max(cursor, int(score))
            if i % (128 * width) == 128 * width - width:
                await asyncio.sleep(0)  # many changes: the data plane runs in between
        if len(rows) < FEED_PAGE * width:
            cursor = max(cursor, seq)  # read everything up to seq
        self._cursors[shard] = cursor

    async def _feed(self, shard: str, after: int) -> list[Any]:
        feed, seq = self.feed_keys(shard)
        floor = f"{self.ns}:chgfloor:{self._t(shard)}" if self.cluster else f"{self.ns}:chgfloor"
        args: list[str | int] = [after, FEED_PAGE, FEED_MAX, self.ns, self._tag, *BRIEF]
        return list(await self._call(lambda: self.scripts.call("feed", [feed, seq, floor], args)))

    async def _page(self, shard: str, now: float, offset: int) -> list[Any]:
        args: list[str | int] = [repr(now), LOAD_PAGE, self.ns, offset, self._tag, *BRIEF]
        keys = [self.dl_key(shard)]
        return list(await self._call(lambda: self.scripts.call("protected", keys, args)))

    async def _load(self, shard: str, seq: int) -> None:
        """(Re)load one shard of the mirror (all of it on a single Redis, one tenant's on a
        cluster) page by page; changes made meanwhile come after ``seq``."""
        found: dict[tuple[str, str], Session] = {}
        width, offset, now = 1 + len(BRIEF), 0, time.time()
        while True:
            flat = await self._page(shard, now, offset)
            for i in range(0, len(flat), width):
                session = brief_session(flat[i : i + width])
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
        self._log_base += len(self._log) + 1  # a reload: every reader starts over
        self._log = []
        self.mirror_loads += 1
