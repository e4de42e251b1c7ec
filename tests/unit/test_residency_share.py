"""The KV-event relay: the subscribing process's residency reaches another process's index
through a real Redis, and the subscription changes hands (in-memory engines, one per process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis

from adapters.kv_events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from proxy import residency_share
from proxy.residency_share import ResidencyShare, decode, encode, records_of, split
from proxy.upstream import Engine
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import wait_for
from tests.unit.test_engine_seam import engine, memory


def test_records_round_trip_and_malformed_payloads_raise() -> None:
    batch = EventBatch(
        1.0,
        (
            BlockStored((1, (1 << 64) - 1), None, (5, 6), 4, "CPU"),
            BlockRemoved((7,), GPU),
            AllBlocksCleared(),
        ),
    )
    records = records_of("e1", batch) + records_of("é", None)
    origin, back = decode(encode(b"12345678", records))
    assert origin == b"12345678"
    assert back == [
        (b"s", "e1", "CPU", (1, (1 << 64) - 1)),
        (b"r", "e1", GPU, (7,)),
        (b"x", "e1", "", ()),
        (b"x", "é", "", ()),
    ]
    payload = encode(b"12345678", records)
    with pytest.raises(ValueError, match="truncated"):
        decode(payload[:-3])
    with pytest.raises(ValueError, match="unknown"):
        decode(b"12345678" + b"?" + payload[9:])


def test_long_records_are_split_into_messages_in_order() -> None:
    records = [(b"R", "a", "", ()), (b"S", "a", GPU, tuple(range(10))), (b"k", "a", "", ())]
    parts = split(records, limit=4)
    assert [[(k, len(h)) for k, _, _, h in part] for part in parts] == [
        [(b"R", 0), (b"S", 4)],
        [(b"S", 4)],
        [(b"S", 2), (b"k", 0)],
    ]
    assert [x for part in parts for _, _, _, hs in part for x in hs] == list(range(10))
    assert split([(b"x", "a", "", ())]) == [[(b"x", "a", "", ())]]


@asynccontextmanager
async def _process(url: str, namespace: str) -> AsyncIterator[tuple[Engine, ResidencyShare]]:
    """One process's view of engine "a": its signals and its relay (own Redis clients)."""
    e = engine("a")
    await e.signals.connect(discover_cache=True)
    redis, subscriber = Redis.from_url(url), Redis.from_url(url)
    share = ResidencyShare(redis, subscriber, namespace, {"a": e.signals})
    share.start()
    try:
        await asyncio.wait_for(share.subscribed.wait(), 5)
        yield e, share
    finally:
        await share.stop()
        await e.signals.aclose()
        await redis.aclose()
        await subscriber.aclose()


async def test_the_holders_residency_reaches_the_other_process_and_hands_over(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(residency_share, "FLUSH_S", 0.001)
    async with (
        _process(redis_server.url, namespace) as (holder, _),
        _process(redis_server.url, namespace) as (other, _),
    ):
        holder.signals.subscribe()
        assert holder.signals.subscribed and not other.signals.subscribed
        assert memory(other).subscription is None  # one subscriber to the engine
        tokens = list(range(40))  # 10 blocks of 4
        blocks = holder.adapter.hash_blocks(tokens)
        memory(holder).serve(tokens)

        async def relayed(n: int) -> bool:
            return other.signals.resident(blocks) == n

        assert await wait_for(lambda: relayed(10), within=5)
        assert other.signals.mode == "events"
        assert other.signals.view()["kv_events"] == {
            "subscribed": False,
            "source": "relay",
            "relayed_batches": other.signals.relayed_batches,
        }
        assert other.signals.relayed_batches >= 1 and holder.signals.relayed_batches == 0
        holder.signals.matched()  # the holder's hash self-check passed: the other reports it

        async def match() -> bool:
            return other.signals.hashes_match

        assert await wait_for(match, within=5)
        # a process that joins later gets the holder's snapshot
        async with _process(redis_server.url, namespace) as (late, share):

            async def snapshot() -> bool:
                late_ok = late.signals.resident(blocks) == 10 and late.signals.hashes_match
                return late_ok and share.snapshots == 1

            assert await wait_for(snapshot, within=5)
        memory(holder).evict_all()
        assert await wait_for(lambda: relayed(0), within=5)
        # the lease changes hands: the old holder learns from the new one's relay
        await holder.signals.unsubscribe()
        other.signals.subscribe()
        memory(other).serve(tokens)

        async def back() -> bool:
            return holder.signals.resident(blocks) == 10

        assert await wait_for(back, within=5)
        assert holder.signals.view()["kv_events"]["source"] == "relay"
        # the hash self-check of the subscribing process failed: everyone falls back
        await other.signals.fall_back()

        async def off() -> bool:
            return holder.signals.mode == "feedback" and holder.signals.resident(blocks) is None

        assert await wait_for(off, within=5)
        holder.signals.subscribe()  # a later holder does not subscribe to untrusted events
        assert not holder.signals.subscribed
