"""Cache-aware dispatch: the engine's queue kept short, kvkeeper's own queue served best first.

vLLM admits waiting requests first come, first served, and a waiting request holds no blocks:
while it waits, running requests evict the very prefix it would have hit. SGLang answers this
inside its engine by serving the longest cached prefix first; kvkeeper does it from outside.
Per engine, at most ``ahead`` streamed requests may be dispatched and not yet started (no first
byte: waiting or prefilling there). The others wait here and go out best first: fewest tokens
the engine would have to compute (prompt minus the session's resident prefix), so a request
whose prefix is still resident is admitted before LRU takes it, and short prefills are not
stuck behind long ones. A request that has waited ``max_wait_s`` goes next whatever its cost,
so no request starves.

Non-streamed requests are not held: their first byte is their last, so they would hold a slot
for the whole generation. They still count while they are not started, like any other request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Ticket:
    """One request's place at one engine."""

    engine: str
    cost: float
    queued_at: float
    future: asyncio.Future[None] | None = None
    started: bool = False
    seq: int = 0


@dataclass
class _EngineQueue:
    not_started: int = 0
    waiting: list[Ticket] = field(default_factory=list)


class DispatchGate:
    """``enter`` before sending, ``started`` at the first byte, ``leave`` when done."""

    def __init__(self, ahead: int, max_wait_s: float) -> None:
        self.ahead = ahead
        self.max_wait_s = max_wait_s
        self._engines: dict[str, _EngineQueue] = {}
        self._seq = itertools.count()
        self.held = 0  # requests that had to wait here (for metrics and tests)

    def queued(self, engine: str) -> int:
        q = self._engines.get(engine)
        return len(q.waiting) if q is not None else 0

    async def enter(self, engine: str, cost: float, *, hold: bool = True) -> Ticket:
        """Wait for a slot at ``engine`` (``hold=False``: count the request, never wait)."""
        q = self._engines.setdefault(engine, _EngineQueue())
        ticket = Ticket(engine, cost, time.monotonic(), seq=next(self._seq))
        if not hold or (q.not_started < self.ahead and not q.waiting):
            q.not_started += 1
            return ticket
        self.held += 1
        ticket.future = asyncio.get_running_loop().create_future()
        q.waiting.append(ticket)
        try:
            await ticket.future
        except BaseException:
            if ticket in q.waiting:
                q.waiting.remove(ticket)
            elif ticket.future.done() and not ticket.future.cancelled():
                self._release(q)  # the slot was handed over just as the caller went away
            raise
        return ticket

    def started(self, ticket: Ticket) -> None:
        if not ticket.started:
            ticket.started = True
            self._release(self._engines[ticket.engine])

    def leave(self, ticket: Ticket) -> None:
        self.started(ticket)

    def _release(self, q: _EngineQueue) -> None:
        q.not_started -= 1
        while q.waiting and q.not_started < self.ahead:
            nxt = self._next(q.waiting, time.monotonic())
            q.waiting.remove(nxt)
            q.not_started += 1
            assert nxt.future is not None
            nxt.future.set_result(None)

    def _next(self, waiting: list[Ticket], now: float) -> Ticket:
        overdue = [t for t in waiting if now - t.queued_at >= self.max_wait_s]
        if overdue:
            return min(overdue, key=lambda t: t.seq)
        return min(waiting, key=lambda t: (t.cost, t.seq))
