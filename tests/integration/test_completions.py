"""Finished requests are merged per session and written in batches, against a real Redis."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from redis.asyncio import Redis

import proxy.app
from proxy.completions import CompletionWriter
from proxy.context import decode_context
from proxy.hint_model import Hint
from proxy.runtime import RUNTIME
from proxy.settings import Limits
from proxy.store import SessionStore, Usage
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN_HEADERS, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "shared prefix " * 40}]}


def _store(url: str, namespace: str, **limits: int) -> SessionStore:
    return SessionStore(Redis.from_url(url), Limits(**limits), namespace=namespace)


async def _add(w: CompletionWriter, sid: str, prompt: int, cached: int, engine: str) -> None:
    body = json.dumps({**CHAT, "n": prompt}).encode()
    w.add(
        "t",
        sid,
        engine=engine,
        usage=Usage(prompt, cached, 1),
        route="/v1/chat/completions",
        body=body,
        breakpoint=None,
        block_offset=None,
        now=time.time(),
    )


async def test_requests_of_one_session_merge_into_one_record(
    redis_server: RedisServer, namespace: str
) -> None:
    store = _store(redis_server.url, namespace)
    writer = CompletionWriter(store, interval_s=10)  # only explicit flushes
    try:
        await store.upsert("t", Hint(session_id="a"), time.time())
        for i, (prompt, cached) in enumerate([(100, 0), (120, 96), (150, 112)]):
            await _add(writer, "a", prompt, cached, f"e{i}")
        assert len(writer) == 1
        await writer.flush()
        s = await store.get("t", "a")
        assert s is not None and writer.writes == 1 and len(writer) == 0
        assert s.counters["prompt_tokens"] == 370 and s.counters["cached_tokens"] == 208
        assert s.counters["completion_tokens"] == 3
        assert s.last_prompt_tokens == 150 and s.engine == "e2"  # the latest request's
        blob = await store.get_context("t", "a")
        assert blob is not None and decode_context(blob).body["n"] == 150
        # a session freed while its request ran is not resurrected
        await store.free("t", "a")
        await _add(writer, "a", 10, 0, "e0")
        await writer.flush()
        assert await store.get("t", "a") is None
    finally:
        await store.aclose()
        await store.redis.aclose()


async def test_redis_down_keeps_records_within_the_bound(redis_server: RedisServer) -> None:
    store = _store("redis://127.0.0.1:1/0", "down")  # nothing listens on port 1
    dropped: list[int] = []
    writer = CompletionWriter(store, interval_s=10, max_pending=3, on_drop=dropped.append)
    try:
        for sid in ("a", "b"):
            await _add(writer, sid, 10, 0, "e")
        await writer.flush()  # fails: kept for the next write
        assert len(writer) == 2 and writer.writes == 0 and not dropped
        for sid in ("a", "c", "d"):
            await _add(writer, sid, 10, 0, "e")
        await writer.flush()
        assert len(writer) == 3 and dropped == [1]  # "a" merged, "b" (the oldest) dropped
    finally:
        await store.aclose()
        await store.redis.aclose()


async def test_proxy_writes_many_requests_in_few_round_trips(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finished requests are merged per session and written together: counted in round trips,
    not bounded by how long the requests took (a loaded machine stretches that)."""
    # a loaded machine, not Redis, stalls calls past the fail-fast 0.5 s here (which would
    # forward requests without session features): not what this test is about
    monkeypatch.setattr(proxy.app, "REDIS_TIMEOUT_S", 5.0)
    async with proxy_stack(redis_server.url, namespace) as st:
        n, sessions = 120, 8

        async def one(i: int) -> None:
            hint = {"session_id": f"s{i % sessions}", "cache_control": {"ttl": 60}}
            resp = await st.client.post("/v1/chat/completions", json={**CHAT, "agent_hint": hint})
            assert resp.status == 200
            await resp.read()

        async def check(rounds: int) -> None:
            # the admin API writes what is buffered before it reads
            total = 0
            for i in range(sessions):
                resp = await st.client.get(f"/admin/sessions/s{i}", headers=ADMIN_HEADERS)
                assert resp.status == 200, (rounds, i, await resp.text())
                s = await resp.json()
                assert s["counters"]["requests"] == rounds * n // sessions
                assert s["state"] == "protected"
                total += s["counters"]["prompt_tokens"]
            prompt = len(json.dumps(CHAT["messages"])) // 4  # the fake engine's count
            assert total == rounds * n * prompt

        writer = st.client.app[RUNTIME].completions
        assert writer is not None
        interval = writer.interval_s
        # all within one write interval (the timer held): 120 requests, 8 sessions, 1 write
        writer.interval_s = 3600.0
        await asyncio.gather(*(one(i) for i in range(n)))
        assert writer.writes == 0 and len(writer) == sessions  # merged per session, in memory
        await check(1)
        assert writer.writes == 1
        # at the real interval: at most one write per interval while records wait, however long
        # the burst takes, plus the admin reads' flush
        writer.interval_s = interval
        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(one(i) for i in range(n)))
        windows = (asyncio.get_running_loop().time() - started) / interval
        await check(2)
        assert 2 <= writer.writes <= 1 + math.ceil(windows) + 1, (writer.writes, windows)


async def test_protected_reuses_rows_that_did_not_change(
    redis_server: RedisServer, namespace: str
) -> None:
    """The retention worker reads every protected session each tick; a session whose stored
    fields did not change comes back as the same decoded object, a changed one is decoded anew
    and carries the new values."""
    store = _store(redis_server.url, namespace)
    writer = CompletionWriter(store, interval_s=10)
    try:
        now = time.time()
        for sid in ("a", "b", "c"):
            await store.upsert("t", Hint(session_id=sid, ttl_s=300), now)
        first = {s.session_id: s for s in await store.protected(time.time())}
        assert sorted(first) == ["a", "b", "c"]
        await _add(writer, "b", 100, 0, "e9")
        await writer.flush()
        second = {s.session_id: s for s in await store.protected(time.time())}
        assert second["a"] is first["a"] and second["c"] is first["c"]
        assert second["b"] is not first["b"]
        assert second["b"].engine == "e9" and second["b"].last_prompt_tokens == 100
        await store.free("t", "c")
        third = {s.session_id: s for s in await store.protected(time.time())}
        assert sorted(third) == ["a", "b"] and third["b"] is second["b"]
    finally:
        await store.aclose()
        await store.redis.aclose()


async def _hmgets(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_hmget", {}).get("calls", 0))


async def test_protected_reads_only_what_changed(redis_server: RedisServer, namespace: str) -> None:
    """After the first load, a call reads only the sessions changed since the last one: Redis'
    work per tick is independent of the number of idle protected sessions (issue 29)."""
    store = _store(redis_server.url, namespace)
    try:
        now = time.time()
        await asyncio.gather(
            *(store.upsert("t", Hint(session_id=f"s{i}", ttl_s=300), now) for i in range(3000))
        )
        assert len(await store.protected(time.time())) == 3000
        assert store.mirror_loads == 1
        for idle in (0, 1):  # nothing changed, then five sessions changed
            before = await _hmgets(store.redis)
            for i in range(5 * idle):
                await store.protect("t", f"s{i}", time.time(), 600)
            got = {s.session_id: s for s in await store.protected(time.time())}
            assert await _hmgets(store.redis) - before == 5 * idle  # not 3000
            assert len(got) == 3000 and store.mirror_loads == 1
        assert got["s0"].ttl == 600 and got["s9"].ttl == 300
        # dropped protection, a free and an expiry leave the mirror through the feed too
        await store.protect("t", "s1", time.time(), 0)
        await store.free("t", "s2")
        await store.protect("t", "s3", time.time() - 700, 600)  # its deadline already passed
        got = {s.session_id: s for s in await store.protected(time.time())}
        assert len(got) == 2997 and not {"s1", "s2", "s3"} & set(got)
        # Redis lost its data: the feed's sequence went back, the mirror is reloaded (empty)
        await store.redis.delete(*await store.redis.keys(f"{namespace}:*"))
        await store.upsert("t", Hint(session_id="new", ttl_s=300), time.time())
        assert [s.session_id for s in await store.protected(time.time())] == ["new"]
        assert store.mirror_loads == 2
    finally:
        await store.aclose()
        await store.redis.aclose()
