"""The LMCache adapter against the engine simulator's LMCache-compatible CPU tier.

The simulator serves the coordinator's and the MP server's routes on one port (one tier,
reported as ``l1``), so the same adapter drives the real stack (tests/realengine/test_lmcache.py)
and the simulator. Runs in-process on ephemeral ports; the timing model is sped up.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from adapters.base import EngineRejected, EngineUnavailable, OffloadTier
from adapters.lmcache import LMCacheAdapter, LMCacheConfig
from adapters.vllm import VLLMAdapter
from loadgen.sim.server import SimConfig, Simulator, run_simulator

MODEL = "sim-model"
NUM_BLOCKS = 64  # 2,048 tokens: small enough to flood quickly


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(n)]


@dataclass
class Rig:
    sim: Simulator
    lmc: LMCacheAdapter
    engine: VLLMAdapter


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    config = SimConfig(model=MODEL, num_blocks=NUM_BLOCKS, cpu_blocks=1024, speed=200.0)
    async with run_simulator(config) as sim, aiohttp.ClientSession() as http:
        assert sim.lmcache_url is not None
        lmc = LMCacheAdapter(http, LMCacheConfig(sim.lmcache_url, sim.lmcache_url, MODEL))
        yield Rig(sim, lmc, VLLMAdapter("sim", sim.url, http, model=MODEL))


async def test_lookup_pin_unpin_delete(rig: Rig) -> None:
    assert isinstance(rig.lmc, OffloadTier)
    assert await rig.lmc.health() is True
    prompt = tokens(1, 830)
    assert await rig.lmc.lookup(prompt) == 0
    await rig.engine.touch_tokens(prompt)
    assert await rig.lmc.lookup(prompt) == 768
    assert await rig.lmc.lookup(prompt[:600]) == 512
    chunks = await rig.lmc.chunks(prompt)
    assert [(c.index, c.stored, set(c.tiers)) for c in chunks] == [
        (0, True, {"l1"}),
        (1, True, {"l1"}),
        (2, True, {"l1"}),
    ]

    assert await rig.lmc.pin(prompt) == 3
    assert await rig.lmc.pin(prompt) == 3
    assert sorted((await rig.lmc.pin_counts(prompt)).values()) == [2, 2, 2]
    assert await rig.lmc.unpin(prompt) == 3
    assert sorted((await rig.lmc.pin_counts(prompt)).values()) == [1, 1, 1]

    result = await rig.lmc.delete_prefix(prompt)
    assert (result.chunks, result.deleted_keys["l1"], result.skipped_keys) == (3, 3, 0)
    assert result.unpinned == 1
    assert await rig.lmc.lookup(prompt) == 0
    assert await rig.lmc.pin_counts(prompt) == {}
    assert await rig.lmc.delete(prompt) == 0


async def test_status_usage_clear_quota_and_prefetch(rig: Rig) -> None:
    prompt = tokens(2, 600)
    await rig.engine.touch_tokens(prompt, cache_salt="tenant-a")
    assert await rig.lmc.lookup(prompt) == 0  # the salt is part of the key
    assert await rig.lmc.lookup(prompt, cache_salt="tenant-a") == 512

    l1 = await rig.lmc.l1_status()
    assert (l1.objects, l1.chunk_size) == (2, 256)
    assert 0 < l1.used_bytes < l1.total_bytes
    usage = await rig.lmc.usage()
    assert [(u.tier, u.used_bytes) for u in usage] == [("l1", l1.used_bytes)]

    await rig.lmc.set_quota("tenant-a", 0.25)
    quota = await rig.lmc.get_quota("tenant-a")
    assert (quota.exists, quota.limit_gb) == (True, 0.25)
    assert quota.usage_gb == pytest.approx(l1.used_bytes / 2**30)
    await rig.lmc.delete_quota("tenant-a")
    assert (await rig.lmc.get_quota("tenant-a")).exists is False
    with pytest.raises(EngineRejected) as rejected:
        await rig.lmc.set_quota("tenant-a", -1)
    assert rejected.value.status == 400

    assert await rig.lmc.prefetch_to_l1(prompt, cache_salt="tenant-a") == 2
    await rig.lmc.clear_l1()
    assert (await rig.lmc.l1_status()).objects == 0
    assert await rig.lmc.lookup(prompt, cache_salt="tenant-a") == 0


async def test_offloaded_prefix_loads_back_after_the_pool_is_flooded(rig: Rig) -> None:
    session = tokens(3, 1500)
    await rig.engine.touch_tokens(session)
    assert await rig.lmc.lookup(session) == 1280
    assert await rig.lmc.pin(session) == 5
    for seed in range(3):  # 3 x 1,200 tokens through a 2,048-token pool
        await rig.engine.touch_tokens(tokens(10 + seed, 1200))

    before = await rig.engine.metrics()
    warm = await rig.engine.touch_tokens(session)
    after = await rig.engine.metrics()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # the pool had lost it
    assert (after.external_prefix_cache_hits or 0) - (
        before.external_prefix_cache_hits or 0
    ) == 1280
    assert warm.cached_tokens == 1280

    assert await rig.lmc.delete(session) == 5
    for seed in range(3):
        await rig.engine.touch_tokens(tokens(20 + seed, 1200))
    assert (await rig.engine.touch_tokens(session)).cached_tokens == 0


async def test_unreachable_tier_raises_engine_unavailable() -> None:
    async with aiohttp.ClientSession() as http:
        dead = LMCacheAdapter(http, LMCacheConfig("http://127.0.0.1:9", "http://127.0.0.1:9", "m"))
        assert await dead.health() is False
        with pytest.raises(EngineUnavailable):
            await dead.pin(tokens(4, 256))


async def test_a_tier_with_an_l2_keeps_pinned_chunks_that_l1_lets_go() -> None:
    """``--cpu-l2-blocks``: the simulator's tier has LMCache MP's two levels. A pinned prefix
    that L1's LRU lets go stays in L2 (reported there by the lookup), is loaded back into L1 by
    a prefetch, and is deleted from each level on its own."""
    config = SimConfig(
        model=MODEL, num_blocks=NUM_BLOCKS, cpu_blocks=48, cpu_l2_blocks=48, speed=200.0
    )  # six 256-token chunks in each level
    async with run_simulator(config) as sim, aiohttp.ClientSession() as http:
        assert sim.lmcache_url is not None
        lmc = LMCacheAdapter(http, LMCacheConfig(sim.lmcache_url, sim.lmcache_url, MODEL))
        engine = VLLMAdapter("sim", sim.url, http, model=MODEL)
        session = tokens(20, 800)  # three chunks
        await engine.touch_tokens(session)
        assert await lmc.pin(session) == 3
        for seed in range(3):  # nine more chunks through six-chunk levels
            await engine.touch_tokens(tokens(30 + seed, 800))
        usage = {u.tier: u for u in await lmc.usage()}
        assert set(usage) == {"l1", "l2"} and usage["l2"].capacity_bytes > 0
        placements = [set(c.tiers) for c in await lmc.chunks(session)]
        assert placements == [{"l2"}, {"l2"}, {"l2"}]  # L1 let it go, L2 kept it
        assert await lmc.lookup(session) == 768
        assert await lmc.prefetch_to_l1(session) == 3
        assert [set(c.tiers) for c in await lmc.chunks(session)] == [{"l1", "l2"}] * 3
        await lmc.clear_l1()
        assert [set(c.tiers) for c in await lmc.chunks(session)] == [{"l2"}] * 3
        result = await lmc.delete_prefix(session)
        assert result.deleted_keys.get("l2") == 3
        assert await lmc.lookup(session) == 0
