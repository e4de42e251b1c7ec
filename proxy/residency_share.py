"""One KV-event subscription per engine, its residency relayed to every worker and replica.

Only the process holding an engine's retention lease subscribes to the engine's KV events
(``EngineSignals.subscribe``, on taking the lease; ``unsubscribe`` once another process holds
it). What those events change (block hashes stored or removed per medium, the cache cleared,
the events found untrustworthy by the hash self-check) it publishes here, on one Redis pub/sub
channel; every other process applies it to its own residency index and horizon tap, so
placement, warm-up decisions and the admin views read the same residency in every process,
and a process that takes the lease over already has it. A process that (re)subscribes to the
channel (a worker restarted, a replica added, Redis back) says so, and each subscribing process
answers with a snapshot of its engine's residency, which replaces what the joiner had.
Publishing is batched (one message per ``FLUSH_S``) and best effort, like ``prefix_share``:
with Redis down the others keep the residency they had.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

from redis.asyncio import Redis

from adapters.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from proxy.pubsub import Outbox, cancel, follow
from proxy.signals import EngineSignals

log = logging.getLogger("kvkeeper.residency_share")

FLUSH_S = 0.02  # relayed events published together (residency this much late elsewhere)
# block hashes per message at most (8 bytes each): a takeover's replay or a snapshot goes out in
# pieces, well under Redis's output-buffer limit for a pub/sub client
MAX_HASHES = 65_536
ORIGIN_BYTES = 8
_HEAD = struct.Struct("!cBBI")  # kind, engine name length, medium length, block hashes
_STORED, _REMOVED, _CLEARED, _OFF = b"s", b"r", b"x", b"o"
# a process (re)subscribed to the channel and asks for snapshots; a snapshot: the engine's
# residency replaced (reset, then its resident blocks per medium), applied by joining processes
_HELLO, _RESET, _SNAPSHOT = b"h", b"R", b"S"
_MATCH = b"k"  # the subscribing process's hash self-check passed
_KINDS = (_STORED, _REMOVED, _CLEARED, _OFF, _HELLO, _RESET, _SNAPSHOT, _MATCH)
JOIN_S = 5.0  # how long after (re)subscribing a process applies the snapshots it receives

# (kind, engine, medium, block hashes)
Record = tuple[bytes, str, str, Sequence[int]]


def encode(origin: bytes, records: Iterable[Record]) -> bytes:
    parts = [origin]
    for kind, engine, medium, hashes in records:
        name, med = engine.encode()[:255], medium.encode()[:255]
        parts += [_HEAD.pack(kind, len(name), len(med), len(hashes)), name, med]
        if hashes:
            parts.append(struct.pack(f"!{len(hashes)}Q", *hashes))
    return b"".join(parts)


def decode(payload: bytes) -> tuple[bytes, list[Record]]:
    """(origin, records); raises ValueError on a malformed payload."""
    origin, pos = payload[:ORIGIN_BYTES], ORIGIN_BYTES
    out: list[Record] = []
    while pos < len(payload):
        if pos + _HEAD.size > len(payload):
            raise ValueError("truncated residency record")
        kind, n_name, n_medium, n = _HEAD.unpack_from(payload, pos)
        if kind not in _KINDS:
            raise ValueError(f"unknown residency record {kind!r}")
        pos += _HEAD.size
        end = pos + n_name + n_medium + 8 * n
        if end > len(payload):
            raise ValueError("truncated residency record")
        engine = payload[pos : pos + n_name].decode()
        medium = payload[pos + n_name : pos + n_name + n_medium].decode()
        hashes = struct.unpack_from(f"!{n}Q", payload, pos + n_name + n_medium)
        out.append((kind, engine, medium, hashes))
        pos = end
    return origin, out


def records_of(engine: str, batch: EventBatch | None) -> list[Record]:
    """What one applied batch (None: a cleared cache) changed, as records."""
    if batch is None:
        return [(_CLEARED, engine, "", ())]
    out: list[Record] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            out.append((_STORED, engine, event.medium, event.block_hashes))
        elif isinstance(event, BlockRemoved):
            out.append((_REMOVED, engine, event.medium, event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            out.append((_CLEARED, engine, "", ()))
    return out


def split(records: Sequence[Record], limit: int = MAX_HASHES) -> list[list[Record]]:
    """``records`` in order, in messages of at most ``limit`` block hashes (a longer record
    split into several of its kind: stored, removed and snapshot records are per block)."""
    parts: list[list[Record]] = [[]]
    room = limit
    for kind, engine, medium, hashes in records:
        while True:
            if not room and parts[-1]:
                parts.append([])
                room = limit
            piece = hashes[:room]
            parts[-1].append((kind, engine, medium, piece))
            room -= len(piece)
            hashes = hashes[len(piece) :]
            if not hashes:
                break
    return parts


class ResidencyShare:
    """Relay what this process's subscriptions apply; apply what the others relay."""

    def __init__(
        self,
        redis: Redis,
        subscriber: Redis,
        namespace: str,
        signals: Mapping[str, EngineSignals],
    ) -> None:
        self.redis = redis
        self.subscriber = subscriber  # a client whose connection a subscription may hold
        self.channel = f"{namespace}:residency"
        self.signals = signals
        self.origin = uuid.uuid4().bytes[:ORIGIN_BYTES]
        self.subscribed = asyncio.Event()
        self._out: Outbox[Record] = Outbox(
            redis,
            self.channel,
            lambda records: (encode(self.origin, p) for p in split(records)),
            FLUSH_S,
        )
        self._listening: asyncio.Task[None] | None = None
        self._joining_until = 0.0  # snapshots are applied until then
        self.snapshots = 0  # snapshots this process applied
        for name, sig in signals.items():
            sig.tap.relay = _Relay(self, name, sig)
            sig.on_fallback = self.fell_back
            sig.on_match = self.matched

    def fell_back(self, engine: str) -> None:
        """The hash self-check here found the engine's hashes differ: the others stop too."""
        self.publish([(_OFF, engine, "", ())])

    def matched(self, engine: str) -> None:
        """The hash self-check here passed: the others report it too."""
        self.publish([(_MATCH, engine, "", ())])

    def publish(self, records: list[Record]) -> None:
        self._out.add(records)

    def _hello(self) -> None:
        """Subscribed (again): what was relayed before, or meanwhile, was missed; the holders
        answer with snapshots of their engines' residency."""
        self._joining_until = time.monotonic() + JOIN_S
        self.publish([(_HELLO, "", "", ())])

    def _snapshot(self) -> None:
        """Another process joined: the residency of the engines whose events this one follows."""
        for name, sig in self.signals.items():
            if sig.subscribed:
                index = sig.index
                records: list[Record] = [(_RESET, name, "", ())]
                records += [(_SNAPSHOT, name, m, index.resident_blocks(m)) for m in index.media()]
                if sig.hashes_match:
                    records.append((_MATCH, name, "", ()))
                self.publish(records)

    def start(self) -> None:
        self._listening = asyncio.create_task(
            follow(self.subscriber, self.channel, self.apply, self.subscribed, self._hello),
            name="residency share",
        )

    async def stop(self) -> None:
        await cancel(self._listening)
        await self._out.stop()

    def apply(self, payload: bytes) -> None:
        """Another process's relayed events (this process's own come back and are skipped)."""
        if payload[:ORIGIN_BYTES] == self.origin:
            return
        try:
            _, records = decode(payload)
        except (ValueError, UnicodeDecodeError, struct.error):
            log.warning("residency share: malformed message dropped")
            return
        joining = time.monotonic() < self._joining_until
        events: list[KVEvent] = []
        target: EngineSignals | None = None
        for kind, engine, medium, hashes in records:
            if kind == _HELLO:
                self._snapshot()
                continue
            if kind in (_RESET, _SNAPSHOT) and not joining:
                continue
            sig = self.signals.get(engine)
            if sig is not target and target is not None and events:
                target.relayed(EventBatch(0.0, tuple(events)))
                events = []
            target = sig
            if sig is None:
                continue
            if kind in (_STORED, _SNAPSHOT):
                events.append(BlockStored(tuple(hashes), None, (), 0, medium))
            elif kind == _REMOVED:
                events.append(BlockRemoved(tuple(hashes), medium))
            else:
                if events:
                    sig.relayed(EventBatch(0.0, tuple(events)))
                    events = []
                if kind == _MATCH:
                    sig.hashes_match = True
                elif kind in (_CLEARED, _RESET):
                    self.snapshots += kind == _RESET
                    sig.relayed(None)
                else:
                    sig.relayed_off()
        if target is not None and events:
            target.relayed(EventBatch(0.0, tuple(events)))


class _Relay:
    """The tap's relay for one engine: publishes only while this process holds the engine's
    subscription (what it applied from another's relay is not sent on)."""

    __slots__ = ("name", "share", "sig")

    def __init__(self, share: ResidencyShare, name: str, sig: EngineSignals) -> None:
        self.share, self.name, self.sig = share, name, sig

    def __call__(self, batch: EventBatch | None) -> None:
        if self.sig.subscribed:
            self.share.publish(records_of(self.name, batch))
