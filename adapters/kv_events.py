"""vLLM KV-cache events: wire decoding and a resilient asyncio ZMQ subscriber.

Wire format (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``)::

    PUB multipart   (topic, seq: 8-byte big-endian, payload: msgpack EventBatch)
    replay (ROUTER) a client sends an 8-byte start seq (REQ envelope); the publisher answers
                    (topic, seq, payload) for every buffered batch with seq >= start (older
                    versions: (seq, payload)), then seq -1 with an empty payload as the end.

A batch is ``[ts, [events...], dp_rank]`` (or a map with those fields). Each event is a map
tagged ``{"type": "BlockStored", ...}`` (vLLM >= ~0.24) or, in older versions, a positional
array tagged by its class name (``["BlockStored", hashes, parent, tokens, block_size, lora_id,
medium]``). Block hashes are 64-bit ints, or full digests (bytes) when the engine is configured
so; both are normalised to the int the residency index uses.

The publisher numbers batches from 0 each time it starts, so a sequence number that goes
backwards means the engine restarted with an empty cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from adapters.base import EventSink
from adapters.block_hash import event_id

log = logging.getLogger(__name__)

GPU = "GPU"
_END_SEQ = -1
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became resident in ``medium`` (full blocks, chained from ``parent_block_hash``)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = GPU
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from ``medium``."""

    block_hashes: tuple[int, ...]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (reset, or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: the engine's timestamp, its events, and the DP rank."""

    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None


class EventDecodeError(ValueError):
    """A payload is not a KV event batch."""


def _hash(value: Any) -> int:
    if isinstance(value, bytes | bytearray):
        return event_id(bytes(value))
    if isinstance(value, int):
        return value & _MASK64  # signed ints from some encoders
    raise EventDecodeError(f"bad block hash {value!r}")


def _hashes(values: Any) -> tuple[int, ...]:
    if not values:
        return ()
    if all(type(v) is int for v in values):  # the usual wire form: no call per item
        return tuple(v & _MASK64 for v in values)
    return tuple(_hash(v) for v in values)


def _medium(value: Any) -> str:
    return str(value) if value else GPU


def _from_map(event: dict[str, Any]) -> KVEvent | None:
    kind = event.get("type")
    if kind == "BlockStored":
        parent = event.get("parent_block_hash")
        return BlockStored(
            block_hashes=_hashes(event.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(event.get("token_ids") or ()),
            block_size=int(event.get("block_size") or 0),
            medium=_medium(event.get("medium")),
            lora_name=event.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(event.get("block_hashes")), _medium(event.get("medium")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _from_array(event: list[Any]) -> KVEvent | None:
    kind, fields = event[0], list(event[1:])
    fields += [None] * (6 - len(fields))  # older versions omit trailing fields
    if kind == "BlockStored":
        hashes, parent, tokens, block_size, _lora_id, medium = fields[:6]
        return BlockStored(
            block_hashes=_hashes(hashes),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(tokens or ()),
            block_size=int(block_size or 0),
            medium=_medium(medium),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields[0]), _medium(fields[1]))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_event(event: Any) -> KVEvent | None:
    """One event in either wire form; None for event types kvkeeper does not know."""
    if isinstance(event, dict):
        return _from_map(event)
    if isinstance(event, list | tuple) and event and isinstance(event[0], str):
        return _from_array(list(event))
    raise EventDecodeError(f"bad event {event!r:.80}")


def _read_event(u: msgpack.Unpacker) -> Any:
    """One event from ``u`` as ``unpackb`` would return it, its token ids skipped (read as [])."""
    try:
        n = u.read_array_header()
    except ValueError:  # not an array: the map form (anything else raises below)
        event: dict[Any, Any] = {}
        for _ in range(u.read_map_header()):
            key = u.unpack()
            if key == "token_ids":
                u.skip()
                event[key] = []
            else:
                event[key] = u.unpack()
        return event
    fields: list[Any] = []
    for i in range(n):
        if i == 3 and fields[0] == "BlockStored":  # [kind, hashes, parent, token_ids, ...]
            u.skip()
            fields.append([])
        else:
            fields.append(u.unpack())
    return fields


def _read_events(u: msgpack.Unpacker, payload: bytes, n: int) -> list[Any]:
    """``n`` events from ``u``: a ``BlockStored`` (its kind is in its first bytes, in either
    form) through :func:`_read_event`, any other in one call (thousands of removals a batch)."""
    out: list[Any] = []
    for _ in range(n):
        pos = u.tell()
        stored = payload.find(b"BlockStored", pos, pos + 24) >= 0
        out.append(_read_event(u) if stored else u.unpack())
    return out


def _unpack_without_tokens(payload: bytes) -> Any:
    """``msgpack.unpackb`` of a batch, except that every ``BlockStored``'s token ids are skipped
    in C instead of built as Python ints: for a 100K-token prompt that is most of the payload.
    Anything unexpected raises, and the caller decodes the whole payload instead."""
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(payload), 1))
    u.feed(payload)
    batch: Any
    try:
        n = u.read_array_header()
    except ValueError:
        batch = {}
        for _ in range(u.read_map_header()):
            key = u.unpack()
            batch[key] = (
                _read_events(u, payload, u.read_array_header()) if key == "events" else u.unpack()
            )
    else:
        batch = [u.unpack()]  # ts
        if n > 1:
            batch.append(_read_events(u, payload, u.read_array_header()))
        batch += [u.unpack() for _ in range(n - 2)]
    if u.tell() != len(payload):
        raise ValueError("trailing data")
    return batch


def decode_batch(payload: bytes, *, token_ids: bool = True) -> EventBatch:
    """Decode one msgpack ``EventBatch`` payload (array or map form). ``token_ids=False``: the
    ``BlockStored`` events come without their token ids (kvkeeper's own index needs only the
    hashes), which makes decoding a long prompt's batch several times cheaper, and consecutive
    ``BlockRemoved`` events of one medium come as one (the same blocks, in order)."""
    raw: Any = None
    if not token_ids:
        with contextlib.suppress(Exception):
            raw = _unpack_without_tokens(payload)
    try:
        if raw is None:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError(f"bad batch {raw!r:.80}")
    if not isinstance(events, list):
        raise EventDecodeError("batch without an event list")
    if token_ids:
        decoded = tuple(e for e in (decode_event(ev) for ev in events) if e is not None)
    else:
        decoded = _decode_merging_removals(events)
    return EventBatch(ts=float(ts or 0.0), events=decoded, dp_rank=rank)


def _removal(event: Any) -> tuple[Any, str] | None:
    """(hashes, medium) of a ``BlockRemoved`` in either wire form, else None."""
    if isinstance(event, dict):
        if event.get("type") == "BlockRemoved":
            return event.get("block_hashes"), _medium(event.get("medium"))
    elif isinstance(event, list | tuple) and event and event[0] == "BlockRemoved":
        return (event[1] if len(event) > 1 else None), _medium(event[2] if len(event) > 2 else None)
    return None


def _decode_merging_removals(events: list[Any]) -> tuple[KVEvent, ...]:
    """:func:`decode_event` over ``events``, except that consecutive ``BlockRemoved`` events of
    one medium come as one: vLLM sends one per evicted block, thousands when a long prompt's
    blocks go, and each event costs the proxy's loop more than its hashes do."""
    out: list[KVEvent] = []
    run: list[Any] = []
    medium: str | None = None
    for event in events:
        removal = _removal(event)
        if removal is not None and (medium is None or removal[1] == medium):
            medium = removal[1]
            run.extend(removal[0] or ())
            continue
        if medium is not None:
            out.append(BlockRemoved(_hashes(run), medium))
            run, medium = [], None
        if removal is not None:  # a run of another medium starts
            medium = removal[1]
            run.extend(removal[0] or ())
        elif (decoded := decode_event(event)) is not None:
            out.append(decoded)
    if medium is not None:
        out.append(BlockRemoved(_hashes(run), medium))
    return tuple(out)


def endpoint_for_host(endpoint: str, host: str) -> str:
    """A connectable address for a publisher's bind address (``tcp://*:5557`` -> host)."""
    for wildcard in ("*", "0.0.0.0", "[::]", "::"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:{endpoint.removeprefix(prefix)}"
    return endpoint


@dataclass(slots=True)
class SubscriberStats:
    """Counters a subscriber keeps; exported as metrics by the proxy."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    restarts: int = 0
    reconnects: int = 0
    decode_errors: int = 0
    last_seq: int | None = None
    last_batch_at: float | None = None
    lost_ranges: list[tuple[int, int]] = field(default_factory=list)


class KVEventSubscriber:
    """Follows one engine's KV-event stream into a sink, recovering gaps through replay.

    ``run()`` loops until cancelled: ZMQ reconnects the TCP link by itself (with exponential
    back-off set on the socket); socket errors recreate the socket after a back-off of ours.
    """

    def __init__(
        self,
        endpoint: str,
        sink: EventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
        backoff: tuple[float, float] = (0.1, 5.0),
        context: zmq.asyncio.Context | None = None,
        token_ids: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.token_ids = token_ids  # decode stored blocks' token ids (see decode_batch)
        self.replay_endpoint = replay_endpoint
        self.sink = sink
        self.stats = SubscriberStats()
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._backoff = backoff
        self._ctx = context or zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    # lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Run the subscriber as a background task."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"kv-events {self.endpoint}")

    async def aclose(self) -> None:
        """Stop the background task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait_connected(self, within: float = 5.0) -> None:
        """Wait until the SUB socket is connected (subscriptions may need a moment more)."""
        await asyncio.wait_for(self._connected.wait(), within)

    async def wait_quiet(self, quiet: float = 0.3, within: float = 10.0) -> bool:
        """Wait until no batch has arrived for ``quiet`` seconds; False if not ``within`` s."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            last = self.stats.last_batch_at
            if last is None or time.monotonic() - last >= quiet:
                return True
            await asyncio.sleep(quiet / 3)
        return False

    async def run(self) -> None:
        """Receive batches forever (until cancelled)."""
        delay = self._backoff[0]
        while True:
            sock = self._open()
            try:
                while True:
                    frames = await sock.recv_multipart()
                    await self._on_frames(frames)
                    delay = self._backoff[0]
                    # a backlog of batches arrives as already-done futures, which await
                    # without yielding: let the proxy's requests in between batches
                    await asyncio.sleep(0)
            except zmq.ZMQError as exc:
                self.stats.reconnects += 1
                log.warning("kv events %s: %s; reconnecting in %.1fs", self.endpoint, exc, delay)
            finally:
                self._connected.clear()
                sock.close(linger=0)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff[1])

    # internals ---------------------------------------------------------------------------
    def _open(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RECONNECT_IVL, int(self._backoff[0] * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._backoff[1] * 1000))
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.connect(self.endpoint)
        self._connected.set()
        return sock

    async def _on_frames(self, frames: Sequence[bytes]) -> None:
        if len(frames) not in (2, 3):
            self.stats.decode_errors += 1
            return
        seq = int.from_bytes(frames[-2], "big", signed=True)
        last = self.stats.last_seq
        if last is not None and seq <= last:
            # The publisher's counter restarted: a new engine process, an empty cache.
            self.stats.restarts += 1
            self.sink.clear()
            last = None
        if last is None and seq > 0:
            await self._recover(0, seq)  # joined late: fetch what the buffer still holds
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            await self._recover(last + 1, seq)
        self._apply(seq, frames[-1])

    def _apply(self, seq: int, payload: bytes) -> None:
        self.stats.last_seq = seq
        self.stats.last_batch_at = time.monotonic()
        try:
            batch = decode_batch(payload, token_ids=self.token_ids)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("kv events %s: undecodable batch %d: %s", self.endpoint, seq, exc)
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.sink.apply(batch)

    async def _recover(self, start: int, end: int) -> None:
        """Apply batches [start, end) from the replay endpoint; count what it no longer has."""
        got: list[tuple[int, bytes]] = []
        if self.replay_endpoint is not None:
            got = await self._fetch_replay(start)
        wanted = [(s, p) for s, p in got if start <= s < end]
        for seq, payload in wanted:
            self._apply(seq, payload)
        self.stats.replayed += len(wanted)
        missing = (end - start) - len(wanted)
        if missing > 0:
            self.stats.lost += missing
            self.stats.lost_ranges.append((start, end))
            log.warning(
                "kv events %s: %d batches in [%d, %d) lost", self.endpoint, missing, start, end
            )

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self.replay_endpoint is not None
        # A DEALER speaking REQ's envelope (empty delimiter frame): a REQ socket would accept
        # only the first of the many replies the publisher's ROUTER streams back.
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), self._replay_timeout)
                frames = frames[1:] if frames and frames[0] == b"" else frames
                if len(frames) not in (2, 3):  # (seq, payload) or, since ~0.2x, with topic
                    return out
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_SEQ:
                    return out
                out.append((seq, frames[-1]))
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("kv events replay %s failed: %r", self.replay_endpoint, exc)
            return out
        finally:
            sock.close(linger=0)
