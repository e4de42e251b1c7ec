"""offload / prefetch / evict THROUGH kvkeeper, realized on the real LMCache MP stack + vLLM.

kvkeeper's engine is the second vLLM (LMCacheMPConnector) with ``lmcache: {coordinator_url,
server_url, model_name: <its --model path>}``. A 1,500-token session (five 256-token chunks) is
served through the proxy; a management ``offload`` stores + pins it in LMCache; a flood through
the proxy evicts it from vLLM's 200-block pool; a management ``prefetch`` warms it back, and
vLLM's own counter ``vllm:external_prefix_cache_hits_total`` shows it came from LMCache; a
management ``evict`` deletes its chunks (the coordinator's lookup returns 0).

The module starts its own LMCache stack and vLLM (module-scoped fixtures): slow on 2 cores.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from adapters.lmcache import LMCacheAdapter, LMCacheConfig
from adapters.vllm import VLLMAdapter
from tests.helpers.redis_server import RedisServer
from tests.realengine.lmcache_fixtures import (
    CHUNK_SIZE,
    LMCacheVLLM,
    _clean_prefix_cache,
    lmcache_engine_python,
    lmcache_stack,
    lmcache_vllm,
)
from tests.realengine.test_lmcache import aligned, eventually, tokens
from tests.realengine.test_proxy_real import ADMIN, Client, metric, proxy_for, session_json

__all__ = ["_clean_prefix_cache", "lmcache_engine_python", "lmcache_stack", "lmcache_vllm"]

pytestmark = [pytest.mark.realengine, pytest.mark.lmcache]
log = logging.getLogger(__name__)

SESSION = 1500  # five full chunks (1,280 tokens) + a 220-token tail
FLOOD = 5  # x 1,600 tokens = 250 blocks through a 200-block pool


@pytest.fixture
async def rig(
    lmcache_vllm: LMCacheVLLM, redis_server: RedisServer, namespace: str
) -> AsyncIterator[tuple[Client, LMCacheAdapter, VLLMAdapter]]:
    stack = lmcache_vllm.stack
    tier = {
        "coordinator_url": stack.coordinator_url,
        "server_url": stack.server_url,
        "model_name": lmcache_vllm.model_dir,  # LMCache keys carry vLLM's --model, not its name
    }
    spec = {"url": lmcache_vllm.url, "lmcache": tier}
    async with (
        aiohttp.ClientSession() as http,
        proxy_for(spec, redis_server.url, namespace) as proxy,
    ):
        config = LMCacheConfig(stack.coordinator_url, stack.server_url, lmcache_vllm.model_dir)
        vllm = VLLMAdapter("lmc", lmcache_vllm.url, http, model=lmcache_vllm.served_name)
        yield proxy, LMCacheAdapter(http, config), vllm


async def complete(proxy: Client, prompt: list[int], sid: str | None = None) -> int:
    """One max_tokens=1 completion through kvkeeper; its cached_tokens."""
    body: dict[str, Any] = {"model": "smol", "prompt": prompt, "max_tokens": 1}
    if sid is not None:
        body["agent_hint"] = {"session_id": sid}
    resp = await proxy.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


async def manage(proxy: Client, sid: str, edit: str) -> dict[str, Any]:
    """A management request; the single edit's result."""
    hint = {
        "session_id": sid,
        "context_management": {"manage_request": True, "edits": [{"type": edit}]},
    }
    body = {"model": "smol", "prompt": [1], "agent_hint": hint}
    resp = await proxy.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert answer["object"] == "kvkeeper.management"
    (result,) = answer["results"]
    assert result["type"] == edit
    return dict(result)


async def test_offload_flood_prefetch_resume_evict_through_kvkeeper(
    rig: tuple[Client, LMCacheAdapter, VLLMAdapter],
) -> None:
    proxy, lmc, vllm = rig
    session = tokens(9101, SESSION)
    prefix = aligned(SESSION)
    assert prefix == 1280

    assert await complete(proxy, session, "off-1") == 0
    # vLLM stores the chunks in LMCache as it computes them (write-through, async)
    assert await eventually(lambda: lmc.lookup(session), prefix.__eq__) == prefix
    offload = await manage(proxy, "off-1", "offload")
    log.info("offload: %s", offload)
    assert offload["status"] == "applied", offload
    assert offload["detail"]["stored_tokens"] == prefix
    assert offload["detail"]["pinned_chunks"] == prefix // CHUNK_SIZE
    assert (await session_json(proxy, "off-1"))["state"] == "offloaded"

    for seed in range(FLOOD):
        await complete(proxy, tokens(9200 + seed, 1600))

    before = await vllm.metrics()
    prefetch = await manage(proxy, "off-1", "prefetch")
    after = await vllm.metrics()
    log.info("prefetch: %s", prefetch)
    assert prefetch["status"] == "applied", prefetch
    assert prefetch["detail"]["tier_tokens"] == prefix
    assert prefetch["detail"]["cached_tokens"] >= prefix
    assert after.prefix_cache_hits == before.prefix_cache_hits  # the flood left vLLM nothing
    external = (after.external_prefix_cache_hits or 0) - (before.external_prefix_cache_hits or 0)
    assert external == prefix  # the warm-up loaded the chunk-aligned prefix from LMCache

    resumed = await complete(proxy, session, "off-1")
    assert resumed >= prefix

    evict = await manage(proxy, "off-1", "evict")
    log.info("evict: %s", evict)
    assert evict["status"] == "applied", evict
    assert evict["detail"]["tier_chunks_deleted"] == prefix // CHUNK_SIZE
    assert await eventually(lambda: lmc.lookup(session), (0).__eq__) == 0
    assert (await session_json(proxy, "off-1"))["state"] == "idle"


async def test_a_protected_session_is_pinned_in_lmcache_until_its_protection_ends(
    lmcache_vllm: LMCacheVLLM, redis_server: RedisServer, namespace: str
) -> None:
    """Retention pins what it protects in the tier (proxy/tiers.py, ``tier_pin_share``), on the
    real coordinator: the capacity is read from the MP server's /status, the pins from the
    coordinator's table. Without KV events every protected session is a candidate."""
    stack = lmcache_vllm.stack
    tier = {
        "coordinator_url": stack.coordinator_url,
        "server_url": stack.server_url,
        "model_name": lmcache_vllm.model_dir,
    }
    spec = {"url": lmcache_vllm.url, "lmcache": tier}
    config = LMCacheConfig(stack.coordinator_url, stack.server_url, lmcache_vllm.model_dir)
    session = tokens(9301, SESSION)
    chunks = aligned(SESSION) // CHUNK_SIZE
    async with (
        aiohttp.ClientSession() as http,
        proxy_for(spec, redis_server.url, namespace, tier_pin_share=0.5) as proxy,
    ):
        lmc = LMCacheAdapter(http, config)

        async def turn(ttl: int) -> None:
            hint = {"session_id": "pin-1", "cache_control": {"type": "ephemeral", "ttl": ttl}}
            body = {"model": "smol", "prompt": session, "max_tokens": 1, "agent_hint": hint}
            resp = await proxy.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()

        async def pins() -> dict[str, int]:
            return await lmc.pin_counts(session)

        async def show_state() -> None:
            """What kvkeeper and the tier saw, printed whole for a failure report (pytest
            shortens long assertion messages)."""
            engines = await (await proxy.get("/admin/engines", headers=ADMIN)).text()
            print(f"admin engines: {engines}")
            print(f"session: {await session_json(proxy, 'pin-1')}")
            print(f"tier stores {await lmc.lookup(session)} tokens; {await lmc.l1_status()}")

        await turn(300)
        pinned = await eventually(pins, lambda c: len(c) == chunks)
        if sorted(pinned.values()) != [1] * chunks:
            await show_state()
        assert sorted(pinned.values()) == [1] * chunks, pinned  # once per chunk, not per tick
        assert await metric(proxy, "kvkeeper_tier_pinned_sessions") == 1
        await turn(1)  # the next turn asks for one second: new version pinned, old released
        released = await eventually(pins, lambda c: not c, within=30)
        if released:
            await show_state()
        assert released == {}, released
        assert await metric(proxy, "kvkeeper_tier_pinned_sessions") == 0
