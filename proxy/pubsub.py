"""What the cross-process shares (``prefix_share``, ``residency_share``) have in common: an
outbox that publishes records together, one message per flush interval, best effort, and a
follower that applies every message of a channel, subscribing again after Redis errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger("kvkeeper.pubsub")

R = TypeVar("R")


class Outbox(Generic[R]):
    """Records published on ``channel`` together: the first waits ``flush_s`` for the rest, and
    ``pack`` turns them into the messages sent. With Redis away they are dropped."""

    def __init__(
        self,
        redis: Redis,
        channel: str,
        pack: Callable[[list[R]], Iterable[bytes]],
        flush_s: float,
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.pack = pack
        self.flush_s = flush_s
        self._pending: list[R] = []
        self._flushing: asyncio.Task[None] | None = None

    def add(self, records: Iterable[R]) -> None:
        self._pending.extend(records)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:  # what arrives while a message is on its way goes in the next one
            await asyncio.sleep(self.flush_s)
            pending, self._pending = self._pending, []
            for message in self.pack(pending):
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await self.redis.publish(self.channel, message)

    async def stop(self) -> None:
        await cancel(self._flushing)


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if running) and wait for it to end."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def follow(
    subscriber: Redis,
    channel: str,
    apply: Callable[[bytes], None],
    subscribed: asyncio.Event,
    on_subscribed: Callable[[], None] | None = None,
) -> None:
    """Apply every message of ``channel`` until cancelled, subscribing again after Redis errors
    (``subscribed`` is set while subscribed; ``on_subscribed`` is called on each subscribe)."""
    backoff = 0.1
    while True:
        try:
            async with subscriber.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                subscribed.set()
                if on_subscribed is not None:
                    on_subscribed()
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and isinstance(msg.get("data"), bytes):
                        apply(msg["data"])
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, TimeoutError) as exc:  # Redis away: retry, keep going
            subscribed.clear()
            log.debug("%s: %r; subscribing again in %.1f s", channel, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
