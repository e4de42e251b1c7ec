"""Keep-alive touches and warm-ups: running them to their end, and the session replay.

A touch is a one-token request over a prefix that moves it to LRU's safe end. The runner is
driven by the retention tick: it holds the tasks, settles each one's overhead credit, and counts
a touch the engine served after ``TOUCH_LATE_S`` as late. kvkeeper never aborts a touch it sent:
vLLM with an asynchronous KV connector (LMCache) dies when a request it is loading KV for is
aborted (vllm-project/vllm#43226); a queued touch holds one of retention's touch slots, no blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from adapters.base import AdapterError, TouchResult
from policy import touch_extent
from policy.overhead import SESSION_TOUCH
from proxy.block_cache import BlockCache
from proxy.engine_state import EngineState
from proxy.guards import Guards
from proxy.keys import SessionKey
from proxy.metrics import Metrics
from proxy.store import Session, SessionStore, StoreDown

log = logging.getLogger("kvkeeper.touches")


class PrefixLost(Exception):
    """A touch found none of the session's prefix left on the engine."""


# a keep-alive touch served later than this is counted ``late`` (it still ran: never aborted)
TOUCH_LATE_S = 1.0
# on stop, how long touches in flight may finish before they are cancelled (aborted)
STOP_GRACE_S = 5.0


class TouchRunner:
    """Runs touches as tasks; replays recorded sessions."""

    def __init__(self, store: SessionStore, blocks: BlockCache, metrics: Metrics) -> None:
        self.store = store
        self.blocks = blocks
        self.metrics = metrics
        self.guards: Guards | None = None  # set by Retention: what touches cost, what they kept
        self._tasks: set[asyncio.Task[int]] = set()

    def track(
        self,
        es: EngineState,
        touch: Coroutine[Any, Any, int],
        reserved: float,
        on_done: Callable[[], None],
        kind: str = SESSION_TOUCH,
    ) -> None:
        """Run a touch (returning the prompt tokens it recomputed) as a task ``stop`` cancels;
        when it ends, settle the overhead credit ``reserved`` for it (``kind``: whose estimate
        it updates), then ``on_done``."""
        task = asyncio.create_task(touch)
        self._tasks.add(task)
        load = es.signals.load
        waiting = float(load.waiting or 0) if load is not None else 0.0  # what it queues ahead of

        def done(t: asyncio.Task[int]) -> None:
            self._tasks.discard(t)
            recomputed = 0
            if not t.cancelled():
                if (exc := t.exception()) is not None:
                    log.error("touch on %s failed", es.name, exc_info=exc)
                else:
                    recomputed = t.result()
            es.signals.overhead.settle(reserved, recomputed, touch=True, kind=kind)
            if self.guards is not None:
                self.guards.spent(es.name, recomputed, waiting, time.time())
            on_done()

        task.add_done_callback(done)

    def tasks(self) -> list[asyncio.Task[int]]:
        return list(self._tasks)

    async def finish(self) -> None:
        """Let the touches in flight end (at most ``STOP_GRACE_S``), then cancel the rest:
        a stopping kvkeeper aborts no request it need not (see the module docstring)."""
        pending = list(self._tasks)
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE_S)
        for task in pending:
            task.cancel()

    def spawn_session(self, es: EngineState, session: Session, reserved: float) -> None:
        key = SessionKey(session.tenant, session.session_id)
        es.in_flight.add(key)
        self.track(es, self.touch_session(es, session), reserved, lambda: es.in_flight.discard(key))

    async def touch_session(
        self, es: EngineState, session: Session, limit_blocks: int | None = None
    ) -> int:
        """Refresh the session's prefix; the prompt tokens it recomputed (0: it did not run).
        Only its still-resident leading blocks are re-sent, so a touch recomputes one token
        whatever LRU already took."""
        try:
            result = await self.replay(
                es,
                SessionKey(session.tenant, session.session_id),
                warmup=False,
                limit_blocks=limit_blocks,
                resident_only=True,
            )
        except PrefixLost:
            mark_lost(es, session, self.metrics)
            return 0
        except (AdapterError, StoreDown, ValueError) as exc:
            self.metrics.touches.labels(es.name, "failed").inc()
            log.warning("touch of %s failed: %s", session.session_id, exc)
            return 0
        if result is None:
            self.metrics.touches.labels(es.name, "no_context").inc()
            return 0
        return result.recomputed_tokens

    async def replay(
        self,
        es: EngineState,
        key: SessionKey,
        *,
        warmup: bool,
        limit_blocks: int | None = None,
        resident_only: bool = False,
    ) -> TouchResult | None:
        """Re-send the session's recorded prefix with one output token; record what it cost.

        ``limit_blocks`` caps the prefix at that many blocks; ``resident_only`` (with KV events)
        at the blocks the engine still holds, raising ``PrefixLost`` when it holds none.
        """
        blob = await self.store.get_context(*key)
        if blob is None:
            return None
        contexts = self.blocks.contexts  # decoded, tokenized, hashed once per context version
        view = await contexts.view(key, blob)
        ctx = view.ctx
        signals, adapter = es.signals, es.adapter
        limits = [n for n in (ctx.block_offset, limit_blocks) if n is not None]
        offset = min(limits) if limits else None
        exact = resident_only and signals.has_events and not es.no_tokenize
        if (offset is not None or exact) and adapter.tokenizable(ctx.route):
            salt = ctx.body.get("cache_salt")
            tokens = await contexts.tokens(key, view, es)
            if exact:
                ids = await contexts.block_ids(key, view, es)
                resident = signals.resident_prefix(ids)
                if not warmup:  # stop short of what LRU takes before the touch is served
                    rate = signals.tap.stores.rate(time.time())
                    extent = touch_extent(len(ids), resident, rate, es.touch_latency.get())
                    es.trimmed_blocks += resident - extent
                    resident = extent
                offset = resident if offset is None else min(offset, resident)
                if offset == 0:
                    raise PrefixLost
            assert offset is not None
            # one token past the last whole block: vLLM looks up at most num_tokens - 1 tokens,
            # so a prompt of exactly N blocks would recompute (and not refresh) the N-th
            tokens = tokens[: max(1, offset) * signals.block_size + 1]
            signals.sent(len(tokens))
            result = await adapter.touch_tokens(tokens, cache_salt=salt)
        else:
            result = await adapter.touch(ctx.route, ctx.prefix_body())
            signals.sent(result.prompt_tokens)  # (its length known only now)
        now = time.time()
        signals.note_used(await self.blocks.blocks_of(key), now)
        recomputed = result.recomputed_tokens
        # the session's counters first: with no await after it, a touch is either counted in
        # both places or (cancelled before) in neither
        await self.store.touched(*key, now, recomputed, warmup=warmup)
        if self.guards is not None:  # the prefix it refreshed (or brought back) for the resume
            self.guards.kept(es.name, key, result.prompt_tokens)
        if warmup:
            self.metrics.warmup_prompt_tokens.inc(result.prompt_tokens)
            self.metrics.warmup_recomputed_tokens.inc(recomputed)
        else:
            es.touch_latency.add(result.seconds)
            outcome = "late" if result.seconds > TOUCH_LATE_S else "ok"
            self.metrics.touches.labels(es.name, outcome).inc()
            self.metrics.touch_prompt_tokens.inc(result.prompt_tokens)
            self.metrics.touch_recomputed_tokens.inc(recomputed)
        return result


def mark_lost(es: EngineState, session: Session, metrics: Metrics) -> None:
    """The engine already evicted the session's prefix: a touch would be a full re-prefill
    nobody asked for (the resume pays it if it comes). Counted once per loss: until the
    session records a new context, it is not touched again."""
    key = SessionKey(session.tenant, session.session_id)
    if es.lost.get(key) != session.last_used:
        es.lost[key] = session.last_used
        metrics.touches.labels(es.name, "skipped_lost").inc()


def urgent(es: EngineState, sessions: list[Session], safety_fraction: float) -> set[SessionKey]:
    """Sessions the allocation front has moved far past, whatever the time-based plan says.

    Counted in blocks, not seconds: a burst allocates blocks faster than any rate estimate can
    follow, and ``safety_fraction`` of the free queue is the share a prefix may fall back.
    """
    signals = es.signals
    if signals.load is None or not signals.has_events:
        return set()
    limit = safety_fraction * signals.load.free_blocks
    return {
        key
        for s in sessions
        if (key := SessionKey(s.tenant, s.session_id)) not in es.in_flight
        and signals.tap.allocated_since(s.last_active) >= limit
    }
