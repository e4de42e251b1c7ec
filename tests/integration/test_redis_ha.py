"""Redis HA against real processes: a Sentinel failover under hinted load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from proxy.app import open_redis
from proxy.settings import Limits
from proxy.store import SessionStore
from tests.helpers.redis_ha import SentinelSet
from tests.integration.proxy_fixtures import ADMIN_HEADERS, Stack, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello " * 20}]}


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    ha = SentinelSet().start()
    try:
        yield ha
    finally:
        ha.stop()


async def _load(st: Stack, stop: asyncio.Event, statuses: list[int], hints: list[str]) -> None:
    i = 0
    while not stop.is_set():
        body = {**CHAT, "agent_hint": {"session_id": f"load-{i % 40}"}}
        resp = await st.client.post("/v1/chat/completions", json=body)
        await resp.read()
        statuses.append(resp.status)
        hints.append(resp.headers.get("X-KVKeeper-Hint", ""))
        i += 1


async def test_sentinel_failover_under_load(sentinels: SentinelSet) -> None:
    namespace = "ha"
    store = SessionStore(open_redis(sentinels.url), Limits(), namespace=namespace)
    # two engines: the prefix index is shared between replicas over a pub/sub subscription too
    async with proxy_stack(sentinels.url, namespace, n_engines=2) as st:
        for i in range(20):  # sessions that exist before the failover
            body = {
                **CHAT,
                "agent_hint": {"session_id": f"kept-{i}", "cache_control": {"ttl": 600}},
            }
            assert (await st.client.post("/v1/chat/completions", json=body)).status == 200
        await store.save_tier_pin("e0", "default", "kept-0", b"pin-payload")
        fence = await store.lease("engine:x", "replica-a", 300)
        master = redis.Redis(port=sentinels.master_port, socket_timeout=2)
        synced = master.execute_command("WAIT", 1, 2000)  # type: ignore[no-untyped-call]
        assert synced == 1  # the replica has all of it
        master.close()

        stop = asyncio.Event()
        statuses: list[int] = []
        hints: list[str] = []
        workers = [asyncio.create_task(_load(st, stop, statuses, hints)) for _ in range(6)]
        await asyncio.sleep(1.0)
        sentinels.master.kill()  # kill -9
        killed = time.monotonic()
        while sentinels.master_port_now() == sentinels.master_port:
            assert time.monotonic() - killed < 20, "sentinels did not fail over"
            await asyncio.sleep(0.1)
        promoted = time.monotonic() - killed
        await asyncio.sleep(2.0)  # load keeps flowing on the new master
        stop.set()
        await asyncio.gather(*workers)

        assert len(statuses) > 50 and set(statuses) == {200}  # no client request failed
        assert hints[-1] == "accepted"  # hints recorded again on the promoted replica
        for i in range(20):
            got = await st.client.get(f"/admin/sessions/kept-{i}", headers=ADMIN_HEADERS)
            assert got.status == 200, i
        assert (await store.tier_pins("e0"))[("default", "kept-0")] == b"pin-payload"
        await asyncio.sleep(0.4)  # the lease ran out: the next holder's fence is higher
        assert await store.lease("engine:x", "replica-b", 300) > fence
        print(f"failover: promoted after {promoted:.1f} s, {len(statuses)} requests, all 200")
    await store.aclose()
    await store.redis.aclose()
