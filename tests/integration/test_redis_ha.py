"""Redis HA against real processes: a Sentinel failover under hinted load, a 3-master cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from proxy.app import open_redis
from proxy.runtime import RUNTIME
from proxy.settings import Limits
from proxy.store import SessionStore
from tests.helpers.redis_ha import ClusterSet, SentinelSet
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


@pytest.fixture
def cluster() -> Iterator[ClusterSet]:
    c = ClusterSet().start()
    try:
        yield c
    finally:
        c.stop()


async def test_three_master_cluster(cluster: ClusterSet, tmp_path: Path) -> None:
    """Every session feature on a 3-master Redis Cluster: each script call touches one slot (a
    cross-slot call fails in the client), the tenants' keys spread over the masters."""
    tenants = tmp_path / "tenants.yaml"
    names = [f"team-{i}" for i in range(6)]
    tenants.write_text("tenants:\n" + "".join(f"  {n}: {{api_keys: [key-{n}]}}\n" for n in names))
    namespace = "cl"
    async with proxy_stack(cluster.url, namespace, n_engines=2, tenants_file=tenants) as st:
        for n in names:
            auth = {"Authorization": f"Bearer key-{n}"}
            for child in ("a", "b"):
                hint = {
                    "session_id": child,
                    "parent_session_id": "root",
                    "cache_control": {"ttl": 300},
                }
                resp = await st.client.post(
                    "/v1/chat/completions",
                    json={**CHAT, "stream": child == "b", "agent_hint": hint},
                    headers=auth,
                )
                assert resp.status == 200 and resp.headers["X-KVKeeper-Hint"] == "accepted"
                await resp.read()
            failed = {"model": "error", "messages": [], "agent_hint": {"session_id": "gone"}}
            assert (
                await st.client.post("/v1/chat/completions", json=failed, headers=auth)
            ).status == 400
        rt = st.client.app[RUNTIME]
        store = rt.store
        assert store is not None and store.cluster
        await rt.settle()
        listed: list[tuple[str, str]] = []
        cursor: str | None = ""  # "" = the first page
        while cursor is not None:
            page = await (
                await st.client.get(
                    "/admin/sessions",
                    params={"limit": "5", "cursor": cursor},
                    headers=ADMIN_HEADERS,
                )
            ).json()
            listed += [(s["tenant"], s["session_id"]) for s in page["data"]]
            cursor = page["next_cursor"]
        assert sorted(listed) == sorted((n, s) for n in names for s in ("a", "b", "root"))
        root = await (
            await st.client.get(
                "/admin/sessions/root", params={"tenant": "team-3"}, headers=ADMIN_HEADERS
            )
        ).json()
        assert root["children"] == ["a", "b"]
        # the retention worker's view: every tenant's protected sessions, then only changes
        protected = {(s.tenant, s.session_id) for s in await store.protected(time.time())}
        assert protected == {(n, s) for n in names for s in ("a", "b")}  # root: no TTL asked
        loads = store.mirror_loads
        assert await store.protect("team-1", "a", time.time(), 0)
        protected = {(s.tenant, s.session_id) for s in await store.protected(time.time())}
        assert ("team-1", "a") not in protected and store.mirror_loads == loads
        assert await store.protect("team-2", "a", time.time() - 400, 300)  # already due
        assert ("team-2", "a") in await store.due(time.time())
        assert await store.expire("team-2", "a", time.time())
        freed = await st.client.delete(
            "/admin/sessions/root",
            params={"tenant": "team-4", "tree": "true"},
            headers=ADMIN_HEADERS,
        )
        assert sorted((await freed.json())["freed"]) == ["a", "b", "root"]
        protected = {(s.tenant, s.session_id) for s in await store.protected(time.time())}
        assert not any(t == "team-4" for t, _ in protected)
        fence = await store.lease("engine:x", "one", 100)
        await asyncio.sleep(0.2)
        assert await store.lease("engine:x", "two", 100) > fence
        await store.save_tier_pin("e0", "team-5", "a", b"pin")
        assert (await store.tier_pins("e0"))[("team-5", "a")] == b"pin"
        spread = cluster.keys_per_node(f"{namespace}:s:*")
        assert sum(spread) == 3 * len(names) - 3 and sum(1 for c in spread if c) >= 2
