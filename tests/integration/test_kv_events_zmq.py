"""The KV-event subscriber against a real ZMQ PUB + ROUTER speaking vLLM's protocol.

``Publisher`` reproduces ``ZmqEventPublisher``: multipart ``(topic, seq, payload)`` on PUB, a
replay buffer served on ROUTER (0.32 frames ``(topic, seq, payload)``; older ``(seq, payload)``),
sequence numbers restarting at 0 with each process. Gaps are made by keeping a batch in the replay
buffer without sending it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from adapters.kv_events import KVEventSubscriber
from adapters.residency import ResidencyIndex

END = (-1).to_bytes(8, "big", signed=True)


def stored(*hashes: int) -> bytes:
    event = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
             "token_ids": [], "block_size": 32, "medium": "GPU"}  # fmt: skip
    return bytes(msgpack.packb([1.0, [event], 0]))


def removed(*hashes: int) -> bytes:
    return bytes(msgpack.packb([1.0, [["BlockRemoved", list(hashes), "GPU"]], 0]))  # older form


class Publisher:
    """vLLM's publisher protocol on real sockets (PUB + optional replay ROUTER)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        port: int = 0,
        replay: bool = True,
        old_replay_frames: bool = False,
        buffer_steps: int = 100,
    ) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{port or '*'}")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self.requests = 0
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._old = old_replay_frames
        self._buffer: list[tuple[int, bytes]] = []
        self._steps = buffer_steps
        self._seq = 0
        self._task = asyncio.create_task(self._serve()) if self.router else None

    async def publish(self, payload: bytes, *, deliver: bool = True, seq: int | None = None) -> int:
        if seq is None:
            seq, self._seq = self._seq, self._seq + 1
        if deliver:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        self._buffer = [*self._buffer, (seq, payload)][-self._steps :]
        return seq

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            self.requests += 1
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    head = [client, b""] if self._old else [client, b"", b"kv"]
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            tail = [client, b"", END, b""] if self._old else [client, b"", b"", END, b""]
            await self.router.send_multipart(tail)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def until(pred: Callable[[], bool], within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def follow(
    ctx: zmq.asyncio.Context, pub: Publisher, index: ResidencyIndex, **kw: object
) -> KVEventSubscriber:
    sub = KVEventSubscriber(
        pub.endpoint,
        index,
        replay_endpoint=pub.replay_endpoint,
        topic="kv",
        context=ctx,
        **kw,  # type: ignore[arg-type]
    )
    sub.start()
    await sub.wait_connected()
    await asyncio.sleep(0.3)  # slow joiner: the subscription must reach the PUB socket
    return sub


@pytest.mark.parametrize("old_frames", [False, True])
async def test_gap_is_recovered_through_replay(ctx: zmq.asyncio.Context, old_frames: bool) -> None:
    pub = Publisher(ctx, old_replay_frames=old_frames)
    index = ResidencyIndex()
    sub = await follow(ctx, pub, index)
    try:
        await pub.publish(stored(1, 2))
        await until(lambda: index.size() == 2)
        await pub.publish(stored(3), deliver=False)  # lost on the wire
        await pub.publish(removed(1), deliver=False)  # lost on the wire
        await pub.publish(stored(4))
        await until(lambda: sub.stats.last_seq == 3)
        assert index.resident_prefix([2, 3, 4]) == 3
        assert not index.is_resident(1)
        assert (sub.stats.gaps, sub.stats.replayed, sub.stats.lost) == (1, 2, 0)
        assert sub.stats.batches == 4
        assert pub.requests == 1
    finally:
        await sub.aclose()
        await pub.close()


async def test_gap_beyond_the_replay_buffer_is_counted_lost(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx, buffer_steps=2)
    index = ResidencyIndex()
    sub = await follow(ctx, pub, index)
    try:
        await pub.publish(stored(1))
        await until(lambda: index.size() == 1)
        for h in (2, 3, 4, 5):
            await pub.publish(stored(h), deliver=False)
        await pub.publish(stored(6))  # buffer now holds seq 4 (block 5) and seq 5 (block 6)
        await until(lambda: sub.stats.last_seq == 5)
        assert (sub.stats.gaps, sub.stats.replayed, sub.stats.lost) == (1, 1, 3)
        assert sub.stats.lost_ranges == [(1, 5)]
        assert [index.is_resident(h) for h in range(1, 7)] == [1, 0, 0, 0, 1, 1]
    finally:
        await sub.aclose()
        await pub.close()


async def test_dead_replay_endpoint_times_out_and_stream_goes_on(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx, replay=False)
    pub.replay_endpoint = "tcp://127.0.0.1:9"  # nothing answers there
    index = ResidencyIndex()
    sub = await follow(ctx, pub, index, replay_timeout=0.3)
    try:
        await pub.publish(stored(1))
        await pub.publish(stored(2), deliver=False)
        await pub.publish(stored(3))
        await pub.publish(stored(4))
        await until(lambda: index.size() == 3)
        assert (sub.stats.gaps, sub.stats.lost) == (1, 1)
        assert index.resident_count([1, 2, 3, 4]) == 3
    finally:
        await sub.aclose()
        await pub.close()


async def test_late_join_replays_from_zero(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    for h in (1, 2, 3):
        await pub.publish(stored(h))  # nobody listens yet
    index = ResidencyIndex()
    sub = await follow(ctx, pub, index)
    try:
        await pub.publish(stored(4))
        await until(lambda: index.size() == 4)
        assert (sub.stats.gaps, sub.stats.replayed, sub.stats.lost) == (0, 3, 0)
    finally:
        await sub.aclose()
        await pub.close()


async def test_publisher_restart_clears_index_and_reconnects(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    port = int(pub.endpoint.rsplit(":", 1)[1])
    index = ResidencyIndex()
    sub = await follow(ctx, pub, index)
    try:
        for h in (1, 2, 3):
            await pub.publish(stored(h))
        await until(lambda: index.size() == 3)
        await pub.close()
        await asyncio.sleep(0.3)
        # A new engine process on the same port: empty cache, sequence numbers from 0 again.
        pub = Publisher(ctx, port=port, replay=False)
        deadline = asyncio.get_running_loop().time() + 5
        while sub.stats.restarts == 0 and asyncio.get_running_loop().time() < deadline:
            await pub.publish(stored(10), seq=0)  # the first batch, until ZMQ has reconnected
            await asyncio.sleep(0.1)
        await until(lambda: index.is_resident(10))
        assert sub.stats.restarts >= 1
        assert index.resident_count([1, 2, 3]) == 0
        assert index.clears == sub.stats.restarts
        assert sub.stats.lost == 0
    finally:
        await sub.aclose()
        await pub.close()


async def test_undecodable_batch_is_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    index = ResidencyIndex()
    sub = await follow(ctx, pub, index)
    try:
        await pub.publish(b"\xc1garbage")
        await pub.publish(stored(7))
        await until(lambda: index.is_resident(7))
        assert sub.stats.decode_errors == 1
        assert sub.stats.batches == 1
        assert sub.stats.gaps == 0
    finally:
        await sub.aclose()
        await pub.close()
