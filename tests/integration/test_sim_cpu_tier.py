"""The simulator's CPU tier: load-back after device eviction, and the LMCache-shaped API
driven through kvkeeper's own ``LMCacheAdapter``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from adapters.lmcache import LMCacheAdapter, LMCacheConfig
from adapters.prom import parse_text, total
from loadgen.sim import SimConfig, Simulator, run_simulator

MODEL = "sim-model"
SESSION = list(range(20_000, 20_000 + 800))  # 3 full 256-token chunks + 32


@pytest.fixture
async def sim() -> AsyncIterator[Simulator]:
    config = SimConfig(num_blocks=40, cpu_blocks=96, profile="instant", model=MODEL)  # 12 chunks
    async with run_simulator(config) as s:
        yield s


@pytest.fixture
async def lmcache(sim: Simulator) -> AsyncIterator[LMCacheAdapter]:
    assert sim.lmcache_url is not None
    cfg = LMCacheConfig(
        coordinator_url=sim.lmcache_url, server_url=sim.lmcache_url, model_name=MODEL
    )
    async with aiohttp.ClientSession() as http:
        yield LMCacheAdapter(http, cfg)


async def complete(sim: Simulator, prompt: list[int]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        body = {"prompt": prompt, "max_tokens": 1}
        async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data


async def flood(sim: Simulator, n: int = 2) -> None:
    for i in range(n):  # 2 x 25 blocks through a 39-block pool: SESSION is evicted
        await complete(sim, list(range(100_000 * (i + 1), 100_000 * (i + 1) + 800)))


async def test_load_back_after_device_eviction(sim: Simulator, lmcache: LMCacheAdapter) -> None:
    await complete(sim, SESSION)
    assert await lmcache.lookup(SESSION) == 768
    await flood(sim)
    again = await complete(sim, SESSION)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 768  # 3 chunks from the CPU tier (+ whatever the device kept)
    async with aiohttp.ClientSession() as http, http.get(f"{sim.url}/metrics") as resp:
        samples = parse_text(await resp.text())
    external = total(samples, "vllm:external_prefix_cache_hits")
    device = total(samples, "vllm:prefix_cache_hits")
    assert external is not None and external > 0
    assert device is not None and external + device == cached


async def test_pins_survive_lru_and_delete_evicts(sim: Simulator, lmcache: LMCacheAdapter) -> None:
    assert await lmcache.health()
    await complete(sim, SESSION)
    assert await lmcache.pin(SESSION) == 3
    assert await lmcache.pin_counts(SESSION) != {}
    # 12 chunks of CPU capacity; 4 x 3 more chunks force LRU evictions, which skip the pins
    for i in range(4):
        await complete(sim, list(range(300_000 + i * 1000, 300_000 + i * 1000 + 800)))
    assert await lmcache.lookup(SESSION) == 768  # pinned: kept
    status = await lmcache.l1_status()
    assert status.objects == 12
    assert status.used_bytes == status.total_bytes == 12 * 256 * 23_040
    result = await lmcache.delete_prefix(SESSION)
    assert result.chunks == 3
    assert result.deleted_keys["l1"] == 3
    assert result.unpinned == 1
    assert await lmcache.lookup(SESSION) == 0
    assert await lmcache.pin_counts(SESSION) == {}


async def test_usage_quota_and_clear(sim: Simulator, lmcache: LMCacheAdapter) -> None:
    await complete(sim, SESSION)
    (usage,) = await lmcache.usage()
    assert (usage.tier, usage.backend) == ("l1", "dram")
    assert usage.used_bytes == 3 * 256 * 23_040
    await lmcache.set_quota("tenant-a", 0.5)
    quota = await lmcache.get_quota("tenant-a")
    assert (quota.limit_gb, quota.exists) == (0.5, True)
    await lmcache.delete_quota("tenant-a")
    assert not (await lmcache.get_quota("tenant-a")).exists
    await lmcache.clear_l1()
    assert await lmcache.lookup(SESSION) == 0
    chunks = await lmcache.chunks(SESSION)
    assert [c.stored for c in chunks] == [False, False, False]


async def test_wrong_model_name_finds_nothing(sim: Simulator) -> None:
    await complete(sim, SESSION)
    assert sim.lmcache_url is not None
    cfg = LMCacheConfig(sim.lmcache_url, sim.lmcache_url, model_name="served-name")
    async with aiohttp.ClientSession() as http:
        assert await LMCacheAdapter(http, cfg).lookup(SESSION) == 0
