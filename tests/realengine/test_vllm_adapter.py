"""The vLLM adapter against the real engine: hashes vs events, eviction, metrics, discovery."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from adapters.kv_events import BlockRemoved, BlockStored, EventBatch, KVEventSubscriber
from adapters.residency import ResidencyIndex
from adapters.vllm import (
    CHAT_ROUTE,
    COMPLETION_ROUTE,
    EventEndpoints,
    VLLMAdapter,
    discover_event_endpoint,
)
from tests.realengine.conftest import VLLMEngine

pytestmark = pytest.mark.realengine

WORDS = [
    "agent",
    "tool",
    "cache",
    "block",
    "memory",
    "plan",
    "search",
    "answer",
    "result",
    "query",
    "file",
    "patch",
    "test",
    "build",
    "review",
    "summary",
    "context",
    "window",
    "token",
    "prefix",
    "retry",
    "error",
    "branch",
    "merge",
    "deploy",
    "config",
]


def chat_body(tag: str, n_words: int) -> dict[str, Any]:
    rng = random.Random(tag)
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return {
        "model": "smol",
        "messages": [
            {"role": "system", "content": f"You are agent {tag}."},
            {"role": "user", "content": text},
        ],
        "max_tokens": 1,
    }


def random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


@dataclass
class RecordingSink:
    """Feeds the index and keeps every decoded event for assertions."""

    index: ResidencyIndex = field(default_factory=ResidencyIndex)
    stored: list[BlockStored] = field(default_factory=list)
    removed: list[BlockRemoved] = field(default_factory=list)

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.stored.append(ev)
            elif isinstance(ev, BlockRemoved):
                self.removed.append(ev)
        self.index.apply(batch)

    def clear(self) -> None:
        self.index.clear()


async def eventually(pred: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return pred()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def adapter(vllm_engine: VLLMEngine, session: aiohttp.ClientSession) -> VLLMAdapter:
    events = EventEndpoints(vllm_engine.events_endpoint, vllm_engine.replay_endpoint, "kv")
    return VLLMAdapter("e0", vllm_engine.url, session, model=vllm_engine.model, events=events)


@pytest.fixture
async def followed(adapter: VLLMAdapter) -> AsyncIterator[tuple[RecordingSink, KVEventSubscriber]]:
    sink = RecordingSink()
    sub = adapter.subscribe(sink)
    await sub.wait_connected()
    await asyncio.sleep(0.5)  # ZMQ slow joiner: let the subscription reach the publisher
    yield sink, sub
    await sub.aclose()


async def test_block_hashes_match_events_and_eviction_is_indexed(
    adapter: VLLMAdapter, followed: tuple[RecordingSink, KVEventSubscriber]
) -> None:
    sink, sub = followed
    body = chat_body("hashes", 700)
    expected = await adapter.block_ids(CHAT_ROUTE, body)
    tokens = await adapter.tokenize(CHAT_ROUTE, body)
    assert len(expected) == len(tokens) // 32 >= 20

    result = await adapter.touch(CHAT_ROUTE, body)
    assert result.prompt_tokens == len(tokens)
    assert result.cached_tokens == 0
    assert await eventually(lambda: sink.index.resident_prefix(expected) == len(expected))

    engine_hashes = [h for ev in sink.stored for h in ev.block_hashes]
    assert engine_hashes[: len(expected)] == expected  # bit-for-bit, in chain order
    assert sink.stored[0].parent_block_hash is None
    assert sink.stored[0].block_size == 32
    assert sink.stored[0].token_ids[:32] == tuple(tokens[:32])
    assert sub.stats.gaps == 0
    assert sub.stats.lost == 0

    # A second identical request hits the cache: every full block comes back cached.
    again = await adapter.touch(CHAT_ROUTE, body)
    assert again.cached_tokens == len(expected) * 32

    # Flood the 200-block pool with 7 x 1,024 unrelated tokens (224 blocks) to evict it all.
    for seed in range(7):
        await adapter.touch(COMPLETION_ROUTE, {"prompt": random_tokens(seed, 1024)})
    assert await eventually(lambda: sink.index.resident_prefix(expected) == 0)
    removed = {h for ev in sink.removed for h in ev.block_hashes}
    assert set(expected) <= removed
    assert all(sink.index.removed_at(h) is not None for h in expected)
    assert sink.index.size() <= 200
    resumed = await adapter.touch(CHAT_ROUTE, body)
    assert resumed.cached_tokens == 0


async def test_metrics_and_cache_config_discovery(adapter: VLLMAdapter) -> None:
    config = await adapter.discover_cache_config()
    assert (config.block_size, config.num_blocks, config.hash_algo) == (32, 200, "sha256_cbor")
    assert config.hash_seed == "0"

    before = await adapter.metrics()
    assert before.running == 0
    assert before.waiting == 0
    assert before.kv_cache_usage is not None
    assert 0.0 <= before.kv_cache_usage <= 1.0
    assert before.prefix_cache_queries is not None
    assert before.prefix_cache_hits is not None

    prompt = random_tokens(99, 320)  # 10 full blocks
    first = await adapter.touch(COMPLETION_ROUTE, {"prompt": prompt})
    second = await adapter.touch(COMPLETION_ROUTE, {"prompt": prompt})
    assert (first.cached_tokens, second.cached_tokens) == (0, 288)  # last block is recomputed
    after = await adapter.metrics()
    assert after.prefix_cache_queries is not None
    assert after.prefix_cache_hits is not None
    assert after.prefix_cache_queries - before.prefix_cache_queries == 640
    assert after.prefix_cache_hits - before.prefix_cache_hits == 288
    assert after.running == 0


async def test_event_endpoint_discovery(
    vllm_engine: VLLMEngine, session: aiohttp.ClientSession
) -> None:
    found = await discover_event_endpoint(session, vllm_engine.url)
    assert found == EventEndpoints(vllm_engine.events_endpoint, vllm_engine.replay_endpoint, "kv")
    bare = VLLMAdapter("e1", vllm_engine.url, session, model="smol")
    assert "kv_events" not in bare.capabilities
    assert await bare.discover_events() == found
    assert "kv_events" in bare.capabilities


async def test_late_subscriber_recovers_state_through_replay(adapter: VLLMAdapter) -> None:
    prompt = random_tokens(7, 640)  # 20 full blocks
    await adapter.touch(COMPLETION_ROUTE, {"prompt": prompt})
    blocks = adapter.hasher.block_ids(prompt)
    # Joining now, the subscriber missed those batches; its first batch triggers a replay.
    late = RecordingSink()
    sub = adapter.subscribe(late)
    try:
        await sub.wait_connected()
        await asyncio.sleep(0.5)
        await adapter.touch(COMPLETION_ROUTE, {"prompt": random_tokens(8, 64)})
        assert await eventually(lambda: late.index.resident_prefix(blocks) == 20)
        assert sub.stats.replayed >= 1
        assert sub.stats.lost == 0
    finally:
        await sub.aclose()
