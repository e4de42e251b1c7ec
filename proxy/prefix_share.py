"""The prefix index placement uses, shared by every kvkeeper replica and worker through Redis.

Each process publishes the prompt-chunk chains it placed (engine, chain) on one pub/sub channel
and applies what the others publish to its own ``PrefixIndex``, so replicas in front of the same
engines place the same prompt on the same engine instead of each learning its own placements.
Publishing is batched (one message per ``FLUSH_S``) and best effort: with Redis down each
process keeps placing from what it knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import uuid
from collections.abc import Collection, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from policy.prefix_index import PrefixIndex

log = logging.getLogger("kvkeeper.prefix_share")

FLUSH_S = 0.002  # placements published together (a burst is one message)
ORIGIN_BYTES = 8
_DIGEST = 8  # bytes per chain entry (policy.prefix_index.hash_chain)
_HEAD = struct.Struct("!BH")  # engine name length, chain entries


def encode(origin: bytes, placed: Sequence[tuple[str, Sequence[bytes]]]) -> bytes:
    parts = [origin]
    for engine, chain in placed:
        name = engine.encode()[:255]
        parts += [_HEAD.pack(len(name), len(chain)), name, *chain]
    return b"".join(parts)


def decode(payload: bytes) -> tuple[bytes, list[tuple[str, list[bytes]]]]:
    """(origin, [(engine, chain)]); raises ValueError on a malformed payload."""
    origin, pos, out = payload[:ORIGIN_BYTES], ORIGIN_BYTES, []
    while pos < len(payload):
        if pos + _HEAD.size > len(payload):
            raise ValueError("truncated prefix-share record")
        n_name, n_chain = _HEAD.unpack_from(payload, pos)
        pos += _HEAD.size
        end = pos + n_name + n_chain * _DIGEST
        if end > len(payload):
            raise ValueError("truncated prefix-share record")
        engine = payload[pos : pos + n_name].decode()
        pos += n_name
        out.append((engine, [payload[i : i + _DIGEST] for i in range(pos, end, _DIGEST)]))
        pos = end
    return origin, out


class PrefixShare:
    """Publish this process's placements, apply everyone else's to ``index``."""

    def __init__(
        self,
        redis: Redis,
        subscriber: Redis,
        namespace: str,
        index: PrefixIndex,
        engines: Collection[str],
    ) -> None:
        self.redis = redis  # the data plane's client (fails fast)
        self.subscriber = subscriber  # a client of its own: a subscription blocks its connection
        self.channel = f"{namespace}:prefixes"
        self.index = index
        self.engines = frozenset(engines)  # placements on engines this process has are applied
        self.origin = uuid.uuid4().bytes[:ORIGIN_BYTES]
        self.applied = 0  # placements learned from other processes
        self._pending: list[tuple[str, Sequence[bytes]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self._listening: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()

    def placed(self, engine: str, chain: Sequence[bytes]) -> None:
        """``chain`` was sent to ``engine`` by this process: tell the others (soon, batched)."""
        self._pending.append((engine, chain))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:  # what arrives while a message is on its way goes in the next one
            await asyncio.sleep(FLUSH_S)
            pending, self._pending = self._pending, []
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self.redis.publish(self.channel, encode(self.origin, pending))

    def start(self) -> None:
        self._listening = asyncio.create_task(self._listen(), name="prefix share")

    async def stop(self) -> None:
        for task in (self._listening, self._flushing):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _listen(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with self.subscriber.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.subscribed.set()
                    backoff = 0.1
                    while True:
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if msg is not None and isinstance(msg.get("data"), bytes):
                            self.apply(msg["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as exc:  # Redis away: retry, keep placing
                self.subscribed.clear()
                log.debug("prefix share: %r; subscribing again in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    def apply(self, payload: bytes) -> None:
        """Another process's placements (its own come back too and are skipped)."""
        try:
            origin, placed = decode(payload)
        except (ValueError, UnicodeDecodeError):
            log.warning("prefix share: malformed message dropped")
            return
        if origin == self.origin:
            return
        for engine, chain in placed:
            if engine not in self.engines:
                continue
            self.index.insert(engine, chain)
            self.applied += 1
