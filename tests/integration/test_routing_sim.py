"""Placement across two simulated replicas: affinity, children follow the parent, load spreads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

import proxy.placement
from loadgen.sim import SimConfig, run_simulator
from policy.prefix_index import hash_chain
from proxy.app import create_app
from proxy.placement import PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS
from proxy.runtime import RUNTIME
from proxy.settings import load_settings
from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import cached, prompt, wait_for


async def two_replicas(
    stack: AsyncExitStack,
    redis_server: RedisServer,
    namespace: str,
    num_blocks: int = 2000,
    placement: dict[str, Any] | None = None,
    **retention: Any,
) -> TestClient[Any, Any]:
    """kvkeeper in front of two fast simulated replicas (KV events wired)."""
    sims = [
        await stack.enter_async_context(
            run_simulator(SimConfig(num_blocks=num_blocks, speed=50, reply_tokens=1))
        )
        for _ in range(2)
    ]
    settings = load_settings(
        engines=[{"url": s.url, "events": s.events_endpoint} for s in sims],
        redis_url=redis_server.url,
        namespace=namespace,
        health_interval_s=60,
        retention=retention,
        placement=placement or {},
        expose_engines=True,
    )
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings)))
    await client.start_server()
    stack.push_async_callback(client.close)
    return client


async def placed(client: TestClient[Any, Any], tokens: list[int]) -> str:
    """Send an unhinted prompt; the replica kvkeeper placed it on."""
    body = {"model": "sim", "prompt": tokens, "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    await resp.read()
    return str(resp.headers["X-KVKeeper-Engine"])


async def _pools_known(client: TestClient[Any, Any]) -> tuple[Any, list[str]]:
    """The runtime and its replicas' names, once retention has scraped every pool size."""
    rt = client.server.app[RUNTIME]
    assert rt.retention is not None
    names = [e.name for e in rt.pool.engines]

    async def known() -> bool:
        return all(rt.pool.by_name[n].signals.pool_tokens() for n in names)

    assert await wait_for(known), "the replicas' pool sizes were never scraped"
    return rt, names


async def test_sessions_stay_children_follow_and_unhinted_spread(
    redis_server: RedisServer, namespace: str
) -> None:
    async with AsyncExitStack() as stack:
        client = await two_replicas(stack, redis_server, namespace, tick_s=0.05)

        async def send(
            tokens: list[int], hint: dict[str, Any] | None = None
        ) -> tuple[str, dict[str, Any]]:
            body: dict[str, Any] = {"model": "sim", "prompt": tokens, "max_tokens": 1}
            if hint:
                body["agent_hint"] = hint
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200
            return resp.headers["X-KVKeeper-Engine"], dict(await resp.json())

        lead_engine, _ = await send(prompt(1), {"session_id": "lead"})
        for turn in range(4):  # affinity: every turn of a session lands where its prefix is
            engine, answer = await send(prompt(1) + [7] * turn * 40, {"session_id": "lead"})
            assert engine == lead_engine
            assert cached(answer) >= 1984
        for i in range(3):  # children go where the parent's prefix lives
            engine, answer = await send(
                prompt(1) + [9 + i] * 50, {"session_id": f"w{i}", "parent_session_id": "lead"}
            )
            assert engine == lead_engine and cached(answer) >= 1984
        engines = {(await send(prompt(100 + i)))[0] for i in range(6)}
        assert len(engines) == 2  # requests without a session spread over both replicas
        # new sessions (or none) whose prompts share a long prefix follow the replica that has it
        first, _ = await send(prompt(500) + [3] * 10, {"session_id": "n0"})
        for i in range(1, 5):
            hint = {"session_id": f"n{i}"} if i % 2 else None
            engine, answer = await send(prompt(500) + [3 + i] * 10, hint)
            assert engine == first and cached(answer) >= 1984
        # (with and without a hint: the hinted body is re-serialized when the hint is stripped,
        # placement hashes what the client sent)
        rt = client.server.app[RUNTIME]
        assert all(v == 0 for v in rt.placer.prefill_pending.values())  # every request released its
        assert set(rt.placer.prefill_pending) == {e.name for e in rt.pool.engines}  # queued prefill


async def test_a_busy_replica_passes_a_shared_prefix_to_the_idle_one(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement weighs a replica's queued prefill against the prefix it holds: requests that
    share a prefix follow it while its replica keeps up, and go to the other replica (which
    then holds the prefix too) when the queue there outweighs what the prefix saves."""
    async with AsyncExitStack() as stack:
        # a queued token weighs as much as a cached one (the default values the cache 3x)
        monkeypatch.setattr(proxy.placement, "MISS_WEIGHT", 1.0)
        client = await two_replicas(stack, redis_server, namespace)

        def send(tokens: list[int]) -> Awaitable[str]:
            return placed(client, tokens)

        home = await send(prompt(7))
        assert await send(prompt(7) + [5] * 64) == home  # idle: the prefix decides
        # a burst of long requests with the prefix, all at once: once the home replica's queued
        # prefill exceeds what the 2K-token prefix saves, the rest go to the other replica
        burst = await asyncio.gather(*(send(prompt(7) + [9 + i] * 3000) for i in range(6)))
        assert burst[0] == home and len(set(burst)) == 2


async def test_the_prefix_index_holds_no_more_than_each_replica_caches(
    redis_server: RedisServer, namespace: str
) -> None:
    """Placement's memory of what each replica was sent is bounded by that replica's KV cache
    (its pool size from its metrics): a prompt the replica has had to evict no longer counts as
    cached there, so placement does not send its requests back to recompute it."""
    async with AsyncExitStack() as stack:
        client = await two_replicas(stack, redis_server, namespace, num_blocks=300, tick_s=0.05)
        rt, names = await _pools_known(client)
        pool = 300 * SimConfig().block_size
        assert rt.pool.by_name[names[0]].signals.pool_tokens() == pool

        def send(tokens: list[int]) -> Awaitable[str]:
            return placed(client, tokens)

        first = prompt(1)
        home = await send(first)
        raw = json.dumps({"model": "sim", "prompt": first, "max_tokens": 1}).encode()
        chain = hash_chain(raw, PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS)
        assert rt.placer.prefixes.match(home, chain) == len(chain)
        for seed in range(2, 16):  # 14 more 2K-token prompts: 7 per replica, 1.5x its cache
            await send(prompt(seed))
        for name in names:
            limit = rt.placer.prefixes.limit(name)
            assert limit == int(pool / rt.placer.chunk_tokens)
            assert 0 < rt.placer.prefixes.size(name) <= limit
        assert (
            rt.placer.prefixes.match(home, chain) == 0
        )  # the engine evicted it; the index let it go


async def test_the_prefix_index_can_remember_several_caches_worth(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``INDEX_POOL_FACTOR`` 4: the index remembers four caches' worth of prompts per
    replica, so a conversation whose context the engine may have partly kept stays where it
    was (vllm-router's never-forgetting tree does the same); the same 15 prompts that pushed
    the first out of a 1x index leave it claimed."""
    monkeypatch.setattr(proxy.placement, "INDEX_POOL_FACTOR", 4.0)
    async with AsyncExitStack() as stack:
        client = await two_replicas(stack, redis_server, namespace, num_blocks=300, tick_s=0.05)
        rt, names = await _pools_known(client)
        first = prompt(1)
        home = await placed(client, first)
        raw = json.dumps({"model": "sim", "prompt": first, "max_tokens": 1}).encode()
        chain = hash_chain(raw, PREFIX_CHUNK_BYTES, PREFIX_MAX_CHUNKS)
        for seed in range(2, 16):
            await placed(client, prompt(seed))
        pool = 300 * SimConfig().block_size
        for name in names:  # (set at the last placement: tokens per chunk is learned since)
            assert rt.placer.prefixes.limit(name) == pytest.approx(
                4.0 * pool / rt.placer.chunk_tokens, rel=0.05
            )
        assert rt.placer.prefixes.match(home, chain) == len(chain)
        assert await placed(client, first) == home
