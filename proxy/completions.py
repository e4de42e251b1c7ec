"""Finished requests, written to Redis in batches instead of one script call each.

After a hinted request the session gets its engine affinity, usage counters, state and the
context to re-touch. None of it is needed before the answer reaches the client, and a busy
session finishes many requests per second, so :class:`CompletionWriter` merges them per session
in memory (counters summed, the latest request's context kept) and writes everything pending in
one ``complete.lua`` call at most every ``interval_s``. Per request that leaves a dict update on
the hot path; the context is compressed only for the request that is finally written.

Reads that must see every finished request (the admin API, ``manage_request`` edits) call
:meth:`flush` first. When Redis is down the pending records are kept for the next flush, up to
``max_pending`` sessions; beyond that the oldest are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from proxy.context import encode_context
from proxy.known import KnownSessions
from proxy.store import SessionStore, StoreDown, Usage

log = logging.getLogger("kvkeeper.completions")

Key = tuple[str, str]  # (tenant, session id)


@dataclass(slots=True)
class _Pending:
    """One session's finished requests since the last write."""

    now: float
    engine: str
    last: Usage
    total: Usage
    route: str
    body: bytes
    breakpoint: tuple[str, int] | None
    block_offset: int | None

    def merge(self, later: _Pending) -> None:
        t, u = self.total, later.total
        self.total = Usage(
            t.prompt_tokens + u.prompt_tokens,
            t.cached_tokens + u.cached_tokens,
            t.completion_tokens + u.completion_tokens,
        )
        self.now, self.engine, self.last = later.now, later.engine, later.last
        self.route, self.body = later.route, later.body
        self.breakpoint, self.block_offset = later.breakpoint, later.block_offset


class CompletionWriter:
    """Buffers :meth:`add` per session and writes the buffer every ``interval_s``."""

    def __init__(
        self,
        store: SessionStore,
        *,
        interval_s: float = 0.05,
        max_pending: int = 50_000,
        on_drop: Callable[[int], None] | None = None,
        known: KnownSessions | None = None,
    ) -> None:
        self.store = store
        self.known = known  # its written-behind upserts go out first, in the same write
        self.interval_s = interval_s
        self.max_pending = max_pending
        self._on_drop = on_drop
        self._pending: dict[Key, _Pending] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one write at a time, in the order the records were taken
        self.writes = 0  # round trips made (for tests and the overhead benchmark)

    def __len__(self) -> int:
        return len(self._pending)

    def latest(self, tenant: str, sid: str) -> tuple[str, float, int] | None:
        """(engine, finished at, prompt tokens) of the session's newest request not yet written.

        Redis lags the buffer by up to ``interval_s``; the request path reads this to keep a
        session's affinity while its previous request is still buffered here.
        """
        p = self._pending.get((tenant, sid))
        return None if p is None else (p.engine, p.now, p.last.prompt_tokens)

    def add(
        self,
        tenant: str,
        sid: str,
        *,
        engine: str,
        usage: Usage,
        route: str,
        body: bytes,
        breakpoint: tuple[str, int] | None,
        block_offset: int | None,
        now: float,
    ) -> None:
        """Record one finished request; written within ``interval_s``. No I/O."""
        record = _Pending(now, engine, usage, usage, route, body, breakpoint, block_offset)
        current = self._pending.get((tenant, sid))
        if current is None:
            self._pending[(tenant, sid)] = record
        else:
            current.merge(record)
        if self.known is not None:
            self.known.completed(tenant, sid, engine, now, usage.prompt_tokens)
        self.wake()

    def wake(self) -> None:
        """Write within ``interval_s`` (a record or an upsert written behind is waiting)."""
        if self._timer is None and self._writing is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._start)

    @property
    def _due(self) -> bool:
        return bool(self._pending) or (self.known is not None and self.known.pending)

    def _start(self) -> None:
        self._timer = None
        if self._due and self._writing is None:
            self._writing = asyncio.get_running_loop().create_task(self._write_pending())

    async def _write_pending(self) -> None:
        try:
            await self._write_taken()
        except Exception:
            log.exception("writing finished requests failed")
        finally:
            self._writing = None
            if self._due and self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._start)

    async def _write_taken(self) -> None:
        async with self._lock:
            batch, self._pending = self._pending, {}
            if self.known is not None:
                # taken with the records: each record's own upsert is among them (or was sent
                # before), and goes out first, as it would have before the request was answered
                await self.known.write(self.store, self.known.take())
            if batch:
                await self._write(batch)

    async def _write(self, batch: dict[Key, _Pending]) -> None:
        limit = self.store.limits.max_context_bytes
        records = []
        for (tenant, sid), p in batch.items():
            context = encode_context(p.route, p.body, p.breakpoint, p.block_offset)
            if len(context) > limit:
                context = b""  # too large to keep: the session simply cannot be re-touched
            records.append((tenant, sid, p.now, p.engine, p.last, p.total, context))
        try:
            await self.store.record_completions(records)
            self.writes += 1
        except StoreDown:
            self._requeue(batch)

    def _requeue(self, batch: dict[Key, _Pending]) -> None:
        """Keep a failed batch for the next write (older records first), within the bound."""
        for key, later in self._pending.items():
            if key in batch:
                batch[key].merge(later)
            else:
                batch[key] = later
        dropped = max(0, len(batch) - self.max_pending)
        if dropped:
            for key in list(batch)[:dropped]:
                del batch[key]
            if self._on_drop is not None:
                self._on_drop(dropped)
        self._pending = batch

    async def flush(self) -> None:
        """Write everything finished so far (waits for a write already under way)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self._write_taken()

    async def close(self) -> None:
        with contextlib.suppress(StoreDown):
            await self.flush()
