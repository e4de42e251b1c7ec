"""The LMCache adapter and the offload/prefetch cycle against the real MP stack and a real vLLM.

One module on purpose: its session fixtures (a coordinator, an MP server and a second vLLM)
start once per module that imports them, and two engines on 2 cores would be slow.
Prompts are token-id lists (completions), distinct per test, so tests do not share chunks.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest

from adapters.base import EngineRejected, EngineUnavailable, OffloadTier
from adapters.lmcache import LMCacheAdapter, LMCacheConfig
from adapters.vllm import VLLMAdapter
from tests.realengine.lmcache_fixtures import (
    CHUNK_SIZE,
    LMCacheVLLM,
    _clean_prefix_cache,
    lmcache_engine_python,
    lmcache_stack,
    lmcache_vllm,
)

__all__ = ["_clean_prefix_cache", "lmcache_engine_python", "lmcache_stack", "lmcache_vllm"]

pytestmark = [pytest.mark.realengine, pytest.mark.lmcache]

T = TypeVar("T")


def tokens(seed: int, n: int) -> list[int]:
    """A reproducible prompt of ``n`` ordinary token ids (SmolLM2's vocabulary is 49,152)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(n)]


def aligned(n: int) -> int:
    return n // CHUNK_SIZE * CHUNK_SIZE


async def eventually(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], within: float = 60.0
) -> T:
    """Poll ``probe`` until ``done``: LMCache stores, and reports to the coordinator, async."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        value = await probe()
        if done(value) or asyncio.get_running_loop().time() >= deadline:
            return value
        await asyncio.sleep(0.25)


def l2_files(l2_dir: Path, chunk_hashes: set[str]) -> list[Path]:
    """The fs L2 adapter names each object file after its key, chunk hash included."""
    return [p for p in l2_dir.rglob("*") if any(h in p.name for h in chunk_hashes)]


@dataclass
class Clients:
    lmc: LMCacheAdapter
    vllm: VLLMAdapter
    engine: LMCacheVLLM


@pytest.fixture
async def clients(lmcache_vllm: LMCacheVLLM) -> AsyncIterator[Clients]:
    stack = lmcache_vllm.stack
    async with aiohttp.ClientSession() as http:
        config = LMCacheConfig(stack.coordinator_url, stack.server_url, lmcache_vllm.model_dir)
        yield Clients(
            lmc=LMCacheAdapter(http, config),
            vllm=VLLMAdapter("lmc", lmcache_vllm.url, http, model=lmcache_vllm.served_name),
            engine=lmcache_vllm,
        )


async def store(c: Clients, prompt: list[int], *, cache_salt: str | None = None) -> int:
    """Send the prompt through vLLM (which stores it in LMCache); wait until the lookup sees it."""
    await c.vllm.touch_tokens(prompt, cache_salt=cache_salt)
    want = aligned(len(prompt))
    return await eventually(lambda: c.lmc.lookup(prompt, cache_salt=cache_salt), want.__eq__)


async def _tiers(lmc: LMCacheAdapter, prompt: list[int]) -> list[set[str]]:
    return [set(c.tiers) for c in await lmc.chunks(prompt)]


# -- the adapter against the real processes ----------------------------------------------------


async def test_health_status_and_usage(clients: Clients) -> None:
    assert isinstance(clients.lmc, OffloadTier)
    assert await clients.lmc.health() is True
    l1 = await clients.lmc.l1_status()
    assert (l1.total_bytes, l1.chunk_size, l1.l2_adapters) == (1 << 30, 256, 1)
    usage = {(u.tier, u.backend): u for u in await clients.lmc.usage()}
    assert set(usage) == {("l1", "dram"), ("l2", "fs")}
    assert usage["l1", "dram"].capacity_bytes == 1 << 30


async def test_lookup_finds_the_chunk_aligned_prefix_in_both_tiers(clients: Clients) -> None:
    prompt = tokens(101, 830)
    assert await clients.lmc.lookup(prompt) == 0
    assert await store(clients, prompt) == 768
    # L2 is written through asynchronously: the lookup can see L1 before every chunk is in L2
    chunks = await eventually(
        lambda: clients.lmc.chunks(prompt),
        lambda cs: all(c.stored and c.tiers == {"l1", "l2"} for c in cs),
    )
    assert [c.index for c in chunks] == [0, 1, 2]  # the 62-token tail is no chunk
    assert all(c.stored and c.tiers == {"l1", "l2"} for c in chunks)
    assert all(p.size_bytes > 0 for c in chunks for k in c.keys for p in k.placements)
    # A longer request over the same prefix finds the same three chunks, a shorter one fewer.
    assert await clients.lmc.lookup([*prompt, *tokens(102, 300)]) == 768
    assert await clients.lmc.lookup(prompt[:600]) == 512


async def test_pin_and_unpin_answer_with_the_chunk_count(clients: Clients) -> None:
    prompt = tokens(201, 600)
    assert await store(clients, prompt) == 512
    assert await clients.lmc.pin(prompt) == 2
    assert set((await clients.lmc.pin_counts(prompt)).values()) == {1}
    assert await clients.lmc.pin(prompt) == 2  # counted pins
    assert set((await clients.lmc.pin_counts(prompt)).values()) == {2}
    assert await clients.lmc.unpin(prompt) == 2
    assert set((await clients.lmc.pin_counts(prompt)).values()) == {1}
    assert await clients.lmc.unpin(prompt) == 2
    assert await clients.lmc.pin_counts(prompt) == {}


async def test_delete_removes_every_tier_the_l2_files_and_the_pins(clients: Clients) -> None:
    prompt = tokens(301, 800)
    assert await store(clients, prompt) == 768
    # L1 is written through to L2 asynchronously: wait until the coordinator knows both copies.
    both = [{"l1", "l2"}] * 3
    assert await eventually(lambda: _tiers(clients.lmc, prompt), both.__eq__) == both
    hashes = {c.chunk_hash for c in await clients.lmc.chunks(prompt)}
    l2_dir = clients.engine.stack.l2_dir
    assert len(l2_files(l2_dir, hashes)) == 3
    objects_before = (await clients.lmc.l1_status()).objects
    await clients.lmc.pin(prompt)
    await clients.lmc.pin(prompt)

    result = await clients.lmc.delete_prefix(prompt)

    assert (result.chunks, result.deleted_keys, result.skipped_keys) == (3, {"l1": 3, "l2": 3}, 0)
    assert result.unpinned == 2
    assert await eventually(lambda: clients.lmc.lookup(prompt), (0).__eq__) == 0
    chunks = await clients.lmc.chunks(prompt)
    assert [k.placements for chunk in chunks for k in chunk.keys] == [(), (), ()]
    assert l2_files(l2_dir, hashes) == []
    assert await clients.lmc.pin_counts(prompt) == {}
    assert (await clients.lmc.l1_status()).objects == objects_before - 3
    assert await clients.lmc.delete(prompt) == 0  # nothing left: a no-op


async def test_clear_l1_keeps_l2_and_prefetch_brings_it_back(clients: Clients) -> None:
    prompt = tokens(401, 600)
    assert await store(clients, prompt) == 512
    both = [{"l1", "l2"}] * 2  # clear only once the write-through to L2 has landed
    assert await eventually(lambda: _tiers(clients.lmc, prompt), both.__eq__) == both
    await clients.lmc.clear_l1()
    tiers = await eventually(lambda: _tiers(clients.lmc, prompt), lambda t: t == [{"l2"}, {"l2"}])
    assert tiers == [{"l2"}, {"l2"}]
    assert await clients.lmc.lookup(prompt) == 512  # L2 still serves it
    assert (await clients.lmc.l1_status()).objects == 0

    assert await clients.lmc.prefetch_to_l1(prompt) == 2
    assert await eventually(lambda: _tiers(clients.lmc, prompt), both.__eq__) == both


async def test_cache_salt_isolates_keys_and_quota_reports_usage(clients: Clients) -> None:
    prompt = tokens(501, 530)
    assert await store(clients, prompt, cache_salt="tenant-a") == 512
    assert await clients.lmc.lookup(prompt) == 0  # unsalted keys differ
    assert await clients.lmc.lookup(prompt, cache_salt="tenant-b") == 0

    await clients.lmc.set_quota("tenant-a", 0.5)
    quota = await eventually(lambda: clients.lmc.get_quota("tenant-a"), lambda q: q.usage_gb > 0)
    assert (quota.exists, quota.limit_gb) == (True, 0.5)
    assert quota.usage_gb > 0  # two ~5.9 MB chunks
    await clients.lmc.delete_quota("tenant-a")
    assert (await clients.lmc.get_quota("tenant-a")).exists is False
    assert await clients.lmc.delete(prompt, cache_salt="tenant-a") == 2


async def test_errors_map_to_the_adapter_error_tree(clients: Clients) -> None:
    cfg = clients.lmc.config
    async with aiohttp.ClientSession() as http:
        dead = LMCacheAdapter(http, LMCacheConfig("http://127.0.0.1:9", cfg.server_url, "m"))
        assert await dead.health() is False
        with pytest.raises(EngineUnavailable):
            await dead.lookup(tokens(1, 300))
        live = LMCacheAdapter(http, cfg)
        with pytest.raises(EngineRejected) as rejected:
            await live.set_quota("tenant-x", -1.0)
        assert rejected.value.status == 400
        # Keys carry the model: vLLM's served name is not what LMCache stored under.
        other = LMCacheAdapter(http, LMCacheConfig(cfg.coordinator_url, cfg.server_url, "smol"))
        prompt = tokens(601, 300)
        assert await store(clients, prompt) == 256
        assert await other.lookup(prompt) == 0


# -- the offload / prefetch cycle, realized from outside ---------------------------------------


async def test_offloaded_prefix_survives_vllm_eviction_and_loads_back(clients: Clients) -> None:
    session = tokens(701, 1500)
    prefix = aligned(len(session))  # 1280: five chunks

    cold = await clients.vllm.touch_tokens(session)
    assert cold.cached_tokens == 0
    assert await eventually(lambda: clients.lmc.lookup(session), prefix.__eq__) == prefix
    assert await clients.lmc.pin(session) == 5  # offload = stored + pinned

    # Flood the 200-block pool (6,400 tokens) with 5 x 1,600 other tokens: LRU evicts the session.
    for seed in range(5):
        await clients.vllm.touch_tokens(tokens(800 + seed, 1600))

    before = await clients.vllm.metrics()
    warm = await clients.vllm.touch_tokens(session)  # the prefetch: a max_tokens=1 warm-up
    after = await clients.vllm.metrics()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # vLLM itself had nothing left
    external = (after.external_prefix_cache_hits or 0) - (before.external_prefix_cache_hits or 0)
    assert external == prefix
    assert warm.cached_tokens >= prefix

    resume = await clients.vllm.touch_tokens([*session, *tokens(799, 60)])
    assert resume.cached_tokens >= prefix
    print(
        f"\ncold prefill {cold.seconds:.2f}s (1500 tokens); warm-up from LMCache "
        f"{warm.seconds:.2f}s ({warm.cached_tokens} cached); resume {resume.seconds:.2f}s "
        f"({resume.cached_tokens} cached)"
    )

    assert await clients.lmc.delete(session) == 5  # evict
    assert await eventually(lambda: clients.lmc.lookup(session), (0).__eq__) == 0
    await clients.vllm.reset_prefix_cache()
    before = await clients.vllm.metrics()
    gone = await clients.vllm.touch_tokens(session)
    after = await clients.vllm.metrics()
    assert gone.cached_tokens == 0
    assert after.external_prefix_cache_hits == before.external_prefix_cache_hits
