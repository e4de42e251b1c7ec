"""Two kvkeeper replicas in front of the same engines place the same prompt on the same engine:
the prefix index is shared through Redis (proxy/prefix_share.py). Without the share each replica
places from what it sent itself and they disagree (the second case shows the test can fail).
Real redis-server, two real proxy apps, two real HTTP engines."""

from __future__ import annotations

import asyncio

import pytest

from policy.budget import EngineLoad
from proxy.prefix_share import Record, decode, encode
from proxy.runtime import RUNTIME
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import Stack, proxy_stack
from tests.integration.retention_fixtures import wait_for

PROMPTS = [f"task {i}: " + f"context of agent {i}, " * 200 for i in range(6)]  # ~4 KB: 4 chunks


async def _send(st: Stack, prompt: str) -> FakeEngine:
    """Send ``prompt`` through ``st``; the engine that received it."""
    before = [len(e.received) for e in st.engines]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": prompt}]}
    resp = await st.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    await resp.read()
    got = [e for e, n in zip(st.engines, before, strict=True) if len(e.received) > n]
    assert len(got) == 1
    return got[0]


@pytest.mark.parametrize("share", [True, False])
async def test_two_replicas_place_the_same_prompt_on_the_same_engine(
    redis_server: RedisServer, namespace: str, share: bool
) -> None:
    placement = {"placement": {"share": share}}
    async with proxy_stack(redis_server.url, namespace, n_engines=2, overrides=placement) as a:
        urls = [e.url for e in a.engines]
        async with proxy_stack(
            redis_server.url, namespace, n_engines=0, extra_engine_urls=urls, overrides=placement
        ) as b:
            b.engines = a.engines  # the same two engines behind both replicas
            rt_b = b.client.app[RUNTIME]
            if share:
                assert rt_b.prefix_share is not None
                await asyncio.wait_for(rt_b.prefix_share.subscribed.wait(), 10)
            first = [await _send(a, p) for p in PROMPTS]
            assert len({e.name for e in first}) == 2  # replica a used both engines
            if share:  # b has learned a's placements (pub/sub, a few ms)
                learned = rt_b.prefix_share

                async def applied() -> bool:
                    return learned is not None and learned.applied >= len(PROMPTS)

                assert await wait_for(applied, within=5, step=0.01)
            # replica b, the prompts in the other order: the same engines
            second = {p: await _send(b, p) for p in reversed(PROMPTS)}
            agree = [second[p] is e for p, e in zip(PROMPTS, first, strict=True)]
            if share:
                assert all(agree), [
                    (e.name, second[p].name) for p, e in zip(PROMPTS, first, strict=True)
                ]
            else:
                assert not all(agree)


def test_share_message_round_trips_and_rejects_truncation() -> None:
    chain = [bytes([i]) * 8 for i in range(3)]
    records: list[Record] = [
        ("http://e0:1", chain),
        ("e1", 512.0),
        ("e1", chain[:1]),
        ("e0", -8.5),
        ("e0", EngineLoad(pool_blocks=2048, kv_cache_usage=None, waiting=1.0, running=None)),
    ]
    assert decode(encode(b"origin01", records)) == (b"origin01", records)
    with pytest.raises(ValueError, match="truncated"):
        decode(encode(b"origin01", records)[:-3])


async def test_queued_prefill_of_another_replica_counts(
    redis_server: RedisServer, namespace: str
) -> None:
    """What one replica queued at an engine (and saw start) is weighed by the other."""
    async with proxy_stack(redis_server.url, namespace, n_engines=2) as a:
        urls = [e.url for e in a.engines]
        async with proxy_stack(
            redis_server.url, namespace, n_engines=0, extra_engine_urls=urls
        ) as b:
            share_a, share_b = (
                a.client.app[RUNTIME].prefix_share,
                b.client.app[RUNTIME].prefix_share,
            )
            assert share_a is not None and share_b is not None
            await asyncio.wait_for(share_b.subscribed.wait(), 10)
            name = a.client.app[RUNTIME].pool.engines[0].name
            share_a.queued(name, 900.0)

            async def counted(tokens: float) -> bool:
                return bool(share_b.others_queued(name) == tokens)

            assert await wait_for(lambda: counted(900.0), within=5, step=0.01)
            share_a.queued(name, -900.0)
            assert await wait_for(lambda: counted(0.0), within=5, step=0.01)
            assert share_a.others_queued(name) == 0.0  # its own queue is not counted twice
            # the load the lease holder scraped reaches the other process's engine signals
            load = EngineLoad(pool_blocks=1057, kv_cache_usage=0.5, waiting=None, running=3.0)
            share_a.loaded(name, load)
            engine_b = b.client.app[RUNTIME].pool.by_name[name]

            async def loaded() -> bool:
                return bool(engine_b.signals.load == load)

            assert await wait_for(loaded, within=5, step=0.01)
            assert engine_b.signals.pool_tokens() == 1057 * engine_b.signals.block_size
