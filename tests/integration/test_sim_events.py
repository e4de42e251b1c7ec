"""KV events from the simulator over real ZMQ: wire format, hashes, eviction, replay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from adapters.block_hash import BlockHasher
from adapters.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
    decode_batch,
)
from loadgen.sim import SimConfig, Simulator, run_simulator
from loadgen.sim.kv_manager import block_ids

HASHER = BlockHasher(block_size=32, hash_seed="0")


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    async with run_simulator(SimConfig(num_blocks=40, profile="instant")) as s:
        yield s


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


async def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        body = {"prompt": prompt, "max_tokens": 1, **extra}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data


async def subscribe(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.subscribe(b"kv")
    await asyncio.sleep(0.2)  # PUB/SUB slow joiner
    return sub


async def recv_until_quiet(sub: zmq.asyncio.Socket, quiet: float = 0.3) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    while True:
        try:
            out.append(await asyncio.wait_for(sub.recv_multipart(), quiet))
        except TimeoutError:
            return out


async def test_wire_format_and_hashes(sim: Simulator, zctx: zmq.asyncio.Context) -> None:
    sub = await subscribe(zctx, sim.events_endpoint)
    prompt = list(range(7, 7 + 100))
    await complete(sim.url, prompt)
    frames = await recv_until_quiet(sub)
    sub.close()
    assert len(frames) == 1
    topic, seq, payload = frames[0]
    assert topic == b"kv"
    assert int.from_bytes(seq, "big") == 0 and len(seq) == 8
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    assert rank == 0
    assert events == [
        {"type": "BlockStored", "block_hashes": HASHER.block_ids(prompt),
         "parent_block_hash": None, "token_ids": prompt[:96], "block_size": 32,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None] * 3,
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    ]  # fmt: skip


async def test_eviction_events_and_salted_hashes(sim: Simulator, zctx: zmq.asyncio.Context) -> None:  # fmt: skip
    sub = await subscribe(zctx, sim.events_endpoint)
    a = list(range(1000, 1000 + 640))  # 20 blocks; the pool has 39
    b = list(range(5000, 5000 + 640))
    await complete(sim.url, a, cache_salt="t1")
    await complete(sim.url, b)
    batches = [decode_batch(f[2]) for f in await recv_until_quiet(sub)]
    sub.close()
    stored = [e for bt in batches for e in bt.events if isinstance(e, BlockStored)]
    removed = [
        h
        for bt in batches
        for e in bt.events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]
    a_ids = block_ids(a, cache_salt="t1")  # vLLM 0.32 tags the salt: (("cache_salt", s),)
    assert list(stored[0].block_hashes) == a_ids
    assert list(stored[1].block_hashes) == HASHER.block_ids(b)
    # b needed 20 blocks: 19 never-used ones, then a's LAST block (a's blocks were freed tail first)
    assert removed == [a_ids[-1]]


async def test_replay_returns_missed_batches(sim: Simulator, zctx: zmq.asyncio.Context) -> None:
    prompts = [list(range(i * 1000, i * 1000 + 64)) for i in range(1, 4)]
    for p in prompts:  # nobody is subscribed: these batches are only in the replay buffer
        await complete(sim.url, p)
    assert sim.replay_endpoint is not None
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sim.replay_endpoint)
    await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replies = []
    while True:
        _, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 2)
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        replies.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    dealer.close()
    assert [s for s, _ in replies] == [1, 2]
    firsts = [b.events[0] for _, b in replies]
    assert all(isinstance(e, BlockStored) for e in firsts)
    assert [list(e.block_hashes) for e in firsts if isinstance(e, BlockStored)] == [
        HASHER.block_ids(p) for p in prompts[1:]
    ]


class _Sink:
    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.cleared = 0

    def apply(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def clear(self) -> None:
        self.cleared += 1


async def test_project_subscriber_recovers_missed_batches(sim: Simulator) -> None:
    """kvkeeper's own subscriber joins late and fetches batch 0 through replay."""
    prompt = list(range(300))
    await complete(sim.url, prompt)  # batch 0, published before anyone listens
    sink = _Sink()
    subscriber = KVEventSubscriber(
        sim.events_endpoint, sink, replay_endpoint=sim.replay_endpoint, topic="kv"
    )
    subscriber.start()
    try:
        await subscriber.wait_connected()
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as http:
            await http.post(f"{sim.url}/reset_prefix_cache")
        # as in vLLM, the reset's AllBlocksCleared goes out with the next step's batch (1)
        await complete(sim.url, list(range(5000, 5064)))
        for _ in range(100):
            if len(sink.batches) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await subscriber.aclose()
    assert subscriber.stats.replayed == 1
    events = [e for b in sink.batches for e in b.events]
    assert isinstance(events[0], BlockStored)
    assert list(events[0].block_hashes) == HASHER.block_ids(prompt)
    assert isinstance(events[1], AllBlocksCleared)
    assert isinstance(events[2], BlockStored)
    assert list(events[2].block_hashes) == HASHER.block_ids(list(range(5000, 5064)))
