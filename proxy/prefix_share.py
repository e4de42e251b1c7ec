"""What placement weighs, shared by every kvkeeper replica and worker through Redis.

Each process publishes on one pub/sub channel the prompt-chunk chains it placed (engine, chain)
and the prefill it queued at each engine and saw start (+/- tokens), and applies what the others
publish: their chains to its own ``PrefixIndex``, their queued prefill to what it counts per
engine. Replicas in front of the same engines then place the same prompt on the same engine,
weighing the same queues, instead of each learning its own placements from half the traffic.
The holder of an engine's retention lease, the one process that scrapes its metrics, publishes
the load it read (pool size, cache usage, queue), so every process bounds its prefix index by
the engine's pool and weighs the same load.
Publishing is batched (one message per ``FLUSH_S``) and best effort: with Redis down each
process keeps placing from what it knows. The queued prefill of a process not heard from for
``SILENT_S`` (it stopped) no longer counts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
import uuid
from collections.abc import Callable, Collection, Sequence

from redis.asyncio import Redis

from policy.budget import EngineLoad
from policy.prefix_index import PrefixIndex
from proxy.pubsub import Outbox, cancel, follow

log = logging.getLogger("kvkeeper.prefix_share")

FLUSH_S = 0.002  # placements published together (a burst is one message)
SILENT_S = 30.0  # a process not heard from this long has stopped: its queued prefill is dropped
ORIGIN_BYTES = 8
_DIGEST = 8  # bytes per chain entry (policy.prefix_index.hash_chain)
_HEAD = struct.Struct("!BH")  # engine name length, chain entries (a chain record)
_PENDING = struct.Struct("!Bd")  # engine name length, queued prefill tokens (+/-)
_LOAD = struct.Struct("!Bqddd")  # engine name length, pool blocks, usage, waiting, running (NaN)
_CHAIN, _QUEUED, _LOADED = b"c", b"p", b"l"

# one record: a chain placed on an engine, a change of the prefill queued at an engine, or the
# load its lease holder read from its metrics
Record = tuple[str, Sequence[bytes] | float | EngineLoad]


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _none(value: float) -> float | None:
    return None if math.isnan(value) else value


def encode(origin: bytes, records: Sequence[Record]) -> bytes:
    parts = [origin]
    for engine, what in records:
        name = engine.encode()[:255]
        if isinstance(what, float):
            parts += [_QUEUED, _PENDING.pack(len(name), what), name]
        elif isinstance(what, EngineLoad):
            fields = (_nan(what.kv_cache_usage), _nan(what.waiting), _nan(what.running))
            parts += [_LOADED, _LOAD.pack(len(name), what.pool_blocks, *fields), name]
        else:
            parts += [_CHAIN, _HEAD.pack(len(name), len(what)), name, *what]
    return b"".join(parts)


def decode(payload: bytes) -> tuple[bytes, list[Record]]:
    """(origin, records); raises ValueError on a malformed payload."""
    origin, pos = payload[:ORIGIN_BYTES], ORIGIN_BYTES
    out: list[Record] = []
    while pos < len(payload):
        kind = payload[pos : pos + 1]
        head = {_CHAIN: _HEAD, _QUEUED: _PENDING, _LOADED: _LOAD}.get(kind)
        if head is None:
            raise ValueError(f"unknown prefix-share record {kind!r}")
        pos += 1
        if pos + head.size > len(payload):
            raise ValueError("truncated prefix-share record")
        n_name, *values = head.unpack_from(payload, pos)
        pos += head.size
        end = pos + n_name + (values[0] * _DIGEST if head is _HEAD else 0)
        if end > len(payload):
            raise ValueError("truncated prefix-share record")
        engine = payload[pos : pos + n_name].decode()
        pos += n_name
        if head is _HEAD:
            out.append((engine, [payload[i : i + _DIGEST] for i in range(pos, end, _DIGEST)]))
        elif head is _PENDING:
            out.append((engine, float(values[0])))
        else:
            pool, usage, waiting, running = values
            out.append((engine, EngineLoad(pool, _none(usage), _none(waiting), _none(running))))
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
        # prefill the other processes queued, per process: (last heard, per engine tokens)
        self._queued: dict[bytes, tuple[float, dict[str, float]]] = {}
        self._out: Outbox[Record] = Outbox(
            redis, self.channel, lambda records: (encode(self.origin, records),), FLUSH_S
        )
        self._listening: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()
        # where another process's reading of an engine's load goes (set by the app)
        self.on_load: Callable[[str, EngineLoad], None] | None = None

    def placed(self, engine: str, chain: Sequence[bytes]) -> None:
        """``chain`` was sent to ``engine`` by this process: tell the others (soon, batched)."""
        self._publish((engine, chain))

    def queued(self, engine: str, tokens: float) -> None:
        """This process queued (``tokens`` > 0) or saw start (< 0) prefill at ``engine``."""
        self._publish((engine, float(tokens)))

    def loaded(self, engine: str, load: EngineLoad) -> None:
        """This process scraped ``engine``'s metrics (it holds its lease): tell the others."""
        self._publish((engine, load))

    def others_queued(self, engine: str) -> float:
        """Prefill tokens the other live processes have queued at ``engine``."""
        if not self._queued:
            return 0.0
        alive = time.monotonic() - SILENT_S
        return sum(
            by_engine.get(engine, 0.0)
            for heard, by_engine in self._queued.values()
            if heard >= alive
        )

    def _publish(self, record: Record) -> None:
        self._out.add((record,))

    def start(self) -> None:
        self._listening = asyncio.create_task(self._listen(), name="prefix share")

    async def stop(self) -> None:
        await cancel(self._listening)
        await self._out.stop()

    async def _listen(self) -> None:
        await follow(self.subscriber, self.channel, self.apply, self.subscribed)

    def apply(self, payload: bytes) -> None:
        """Another process's placements (its own come back too and are skipped)."""
        try:
            origin, placed = decode(payload)
        except (ValueError, UnicodeDecodeError):
            log.warning("prefix share: malformed message dropped")
            return
        if origin == self.origin:
            return
        now = time.monotonic()
        if origin not in self._queued:  # a process seen first: forget those long silent
            self._queued = {o: q for o, q in self._queued.items() if q[0] >= now - SILENT_S}
        _, queued = self._queued.get(origin, (0.0, {}))
        self._queued[origin] = (now, queued)
        for engine, what in placed:
            if engine not in self.engines:
                continue
            if isinstance(what, float):
                queued[engine] = max(0.0, queued.get(engine, 0.0) + what)
            elif isinstance(what, EngineLoad):
                if self.on_load is not None:
                    self.on_load(engine, what)
            else:
                self.index.insert(engine, what)
                self.applied += 1
