"""The keep-alive mechanism on the real engine: touches keep a session prefix out of LRU's reach.

A ~2K-token session prefix (63 blocks), then a flood of 6 x 2,000 unrelated tokens (375 blocks,
nearly twice the 200-block pool). Untouched, the prefix is evicted completely; touched (through
``adapter.touch``) after every second flood request, it stays resident. Residency is read from
the index the engine's own KV events feed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from adapters.kv_events import KVEventSubscriber
from adapters.residency import ResidencyIndex
from adapters.vllm import CHAT_ROUTE, COMPLETION_ROUTE, EventEndpoints, VLLMAdapter
from tests.realengine.conftest import VLLMEngine
from tests.realengine.test_vllm_adapter import chat_body, eventually, random_tokens

pytestmark = pytest.mark.realengine
log = logging.getLogger(__name__)

FLOOD = 6
FLOOD_TOKENS = 2000


@pytest.fixture
async def rig(
    vllm_engine: VLLMEngine,
) -> AsyncIterator[tuple[VLLMAdapter, ResidencyIndex, KVEventSubscriber]]:
    async with aiohttp.ClientSession() as session:
        events = EventEndpoints(vllm_engine.events_endpoint, vllm_engine.replay_endpoint, "kv")
        adapter = VLLMAdapter("e0", vllm_engine.url, session, model="smol", events=events)
        index = ResidencyIndex()
        sub = adapter.subscribe(index)
        await sub.wait_connected()
        await asyncio.sleep(0.5)  # ZMQ slow joiner
        yield adapter, index, sub
        await sub.aclose()


async def run_session(
    adapter: VLLMAdapter, index: ResidencyIndex, *, tag: str, touch_every: int | None
) -> tuple[list[int], int, int]:
    """Serve the session, flood, optionally touch; return blocks, touches, recomputed tokens."""
    body = chat_body(tag, 2000)
    blocks = await adapter.block_ids(CHAT_ROUTE, body)
    assert 55 <= len(blocks) <= 75  # ~2K tokens
    first = await adapter.touch(CHAT_ROUTE, body)
    assert first.cached_tokens == 0
    index.note_used(blocks)
    assert await eventually(lambda: index.resident_prefix(blocks) == len(blocks))

    touches = recomputed = 0
    for i in range(FLOOD):
        prompt = random_tokens(hash((tag, i)) & 0xFFFF, FLOOD_TOKENS)
        await adapter.touch(COMPLETION_ROUTE, {"prompt": prompt})
        index.note_used(adapter.hasher.block_ids(prompt))
        if touch_every and (i + 1) % touch_every == 0:
            result = await adapter.touch(CHAT_ROUTE, body)
            index.note_used(blocks)
            touches += 1
            recomputed += result.recomputed_tokens
    return blocks, touches, recomputed


async def test_untouched_prefix_is_evicted_by_the_flood(
    rig: tuple[VLLMAdapter, ResidencyIndex, KVEventSubscriber],
) -> None:
    adapter, index, sub = rig
    started = time.time()
    blocks, touches, _ = await run_session(adapter, index, tag="cold", touch_every=None)
    assert touches == 0
    assert await eventually(lambda: index.resident_prefix(blocks) == 0)
    assert index.resident_count(blocks) == 0
    assert all(index.removed_at(h) is not None for h in blocks)
    # The index saw how long the session's blocks sat unused before LRU took them.
    horizon = index.lru_horizon()
    assert horizon is not None
    assert 0.0 < horizon < time.time() - started
    resumed = await adapter.touch(CHAT_ROUTE, chat_body("cold", 2000))
    log.info(
        "untouched: %d blocks, resident 0, horizon %.2fs, resume %s", len(blocks), horizon, resumed
    )
    assert resumed.cached_tokens == 0
    assert sub.stats.lost == 0


async def test_touched_prefix_stays_resident_through_the_flood(
    rig: tuple[VLLMAdapter, ResidencyIndex, KVEventSubscriber],
) -> None:
    adapter, index, sub = rig
    blocks, touches, recomputed = await run_session(adapter, index, tag="warm", touch_every=2)
    assert touches == 3
    assert recomputed <= touches * 32  # a touch recomputes at most the partial tail block
    assert await sub.wait_quiet()
    resident = index.resident_prefix(blocks)
    assert resident >= 0.95 * len(blocks)
    resumed = await adapter.touch(CHAT_ROUTE, chat_body("warm", 2000))
    log.info(
        "touched: %d blocks, resident %d, %d touches recomputing %d tokens, resume %s",
        len(blocks), resident, touches, recomputed, resumed,
    )  # fmt: skip
    assert resumed.cached_tokens >= 0.95 * len(blocks) * 32
    assert sub.stats.lost == 0
