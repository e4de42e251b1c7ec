"""Repeats of a session Redis accepted a moment ago skip the upsert's round trip (proxy/known.py):
answered ``accepted`` from memory, their upsert written behind before their completion, so Redis
ends in the state the synchronous upserts left it in."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from proxy.hint_model import Hint
from proxy.known import KnownSessions
from proxy.runtime import RUNTIME, Runtime
from proxy.store import StoreRejected, Upserted
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import Stack, proxy_stack

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "a long shared system prompt " * 20}],
}


def _hinted(sid: str, ttl: float = 120, **more: Any) -> dict[str, Any]:
    hint = {"session_id": sid, "cache_control": {"type": "ephemeral", "ttl": ttl}, **more}
    return {**CHAT, "agent_hint": hint}


async def _post(st: Stack, body: dict[str, Any]) -> tuple[int, str]:
    resp = await st.client.post("/v1/chat/completions", json=body)
    await resp.read()
    return resp.status, resp.headers.get("X-KVKeeper-Hint", "")


def _rt(st: Stack) -> Runtime:
    app = st.client.app
    assert app is not None
    rt: Runtime = app[RUNTIME]
    return rt


async def test_repeats_skip_the_upsert_and_reach_redis_behind(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.known is not None and rt.store is not None
        assert rt.completions is not None
        rt.completions.interval_s = 30.0  # written when settled
        assert await _post(st, _hinted("k")) == (200, "accepted")
        await rt.settle()
        store, sent = rt.store, []
        upsert, upsert_many = store.upsert, store.upsert_many

        async def registered(*args: Any) -> Any:
            sent.append("upsert")
            return await upsert(*args)

        async def behind(calls: Any) -> Any:
            sent.extend(f"behind x{requests}" for *_, requests, _ in calls)
            return await upsert_many(calls)

        setattr(store, "upsert", registered)  # noqa: B010
        setattr(store, "upsert_many", behind)  # noqa: B010
        start = time.time()
        for _ in range(3):
            assert await _post(st, _hinted("k")) == (200, "accepted")
        assert rt.known.repeats == 3 and sent == []
        await rt.settle()
        assert sent == ["behind x3"]  # one upsert standing for the three repeats
        session = await rt.store.get("default", "k")
        assert session is not None
        assert session.counters["requests"] == 4
        assert session.state == "protected"  # each completion came after its upsert
        assert session.last_seen >= start and session.ttl_until >= start + 120
        assert session.counters["prompt_tokens"] > 0


async def test_another_shape_registers_and_a_failure_forgets_every_session(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.known is not None and rt.store is not None and rt.completions is not None
        rt.completions.interval_s = 30.0  # written when settled: the order is the test's
        await _post(st, _hinted("a"))
        await _post(st, _hinted("a"))  # a repeat, its upsert queued
        await _post(st, _hinted("a", ttl=60))  # another TTL: the upsert decides, at once
        assert rt.known.repeats == 1
        await rt.settle()
        session = await rt.store.get("default", "a")
        # the queued upsert went out after the registration and asked what it asked
        assert session is not None and session.ttl == 60
        assert session.counters["requests"] == 3
        await _post(st, _hinted("a", ttl=60))
        assert rt.known.repeats == 2
        rt.known.forget_all()  # what a failed Redis call does (proxy/app.py)
        await _post(st, _hinted("a", ttl=60))
        assert rt.known.repeats == 2


async def test_a_freed_session_repeated_is_created_again(
    redis_server: RedisServer, namespace: str
) -> None:
    from tests.integration.proxy_fixtures import ADMIN_HEADERS

    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.known is not None and rt.store is not None
        await _post(st, _hinted("f"))
        await rt.settle()
        freed = await st.client.delete("/admin/sessions/f", headers=ADMIN_HEADERS)
        assert freed.status in (200, 204)
        assert await rt.store.get("default", "f") is None
        assert await _post(st, _hinted("f")) == (200, "accepted")
        await rt.settle()
        session = await rt.store.get("default", "f")
        assert session is not None and session.ttl_until > time.time()
        metrics = await (await st.client.get("/metrics")).text()
        assert "kvkeeper_sessions_created_total 2.0" in metrics


async def test_a_failed_repeat_leaves_its_session_kept_and_not_active(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.known is not None and rt.store is not None
        await _post(st, _hinted("x"))
        status, outcome = await _post(st, {**_hinted("x"), "model": "error"})
        assert status == 400 and outcome.startswith("rejected; reason=upstream_status_400")
        assert rt.known.repeats == 1
        for _ in range(50):  # the unregistration runs off the request path
            await asyncio.sleep(0.02)
            session = await rt.store.get("default", "x")
            if session is not None and session.state != "active":
                break
        assert session is not None and session.state == "protected"
        assert session.counters["requests"] == 2


async def test_upserts_written_behind_share_a_script_call(
    redis_server: RedisServer, namespace: str
) -> None:
    """Several sessions' upserts in one script call act as each upsert alone would, and answer
    briefly: whether each created its session, or its rejection."""
    async with proxy_stack(redis_server.url, namespace) as st:
        store = _rt(st).store
        assert store is not None
        now = time.time()
        await store.upsert("t", Hint("old", parent_session_id="p1", ttl_s=60.0), now)
        hints = [
            Hint("old", parent_session_id="p1", ttl_s=60.0),  # exists: refreshed
            Hint("new", parent_session_id="p2", agent_name="coder"),  # created, its parent too
            Hint("old", parent_session_id="other"),  # another parent: rejected
        ]
        batcher = store.scripts
        calls = batcher.calls
        results = await store.upsert_many(
            [("t", h, now + 1, 3, store.upsert_template("t", h)) for h in hints]
        )
        assert batcher.calls - calls == 1  # one script call for the three
        first, second, third = results
        assert first is False and second is True
        assert isinstance(third, StoreRejected) and third.reason == "parent_mismatch"
        old = await store.get("t", "old")
        new = await store.get("t", "new")
        assert old is not None and old.counters["requests"] == 4 and old.ttl_until == now + 61
        assert new is not None and new.agent == "coder" and new.parent == "p2"
        assert await store.get("t", "p2") is not None


def test_what_a_repeat_reads_follows_this_process_completions_and_touches() -> None:
    known = KnownSessions()
    hint = Hint("s", ttl_s=60.0)
    known.accepted("t", hint, Upserted(True, None, None, 0.0, 0))
    known.completed("t", "s", "e1", 100.0, 512)
    first = known.repeat("t", hint, 101.0)
    assert first == Upserted(False, "e1", None, 100.0, 512)
    known.touched("t", "s", 150.0)  # a keep-alive touch this process recorded
    assert known.repeat("t", hint, 151.0) == Upserted(False, "e1", None, 150.0, 512)
    assert known.repeat("t", Hint("s", ttl_s=30.0), 152.0) is None  # another TTL registers
    known.forget_all()
    assert known.repeat("t", hint, 153.0) is None


async def test_a_repeating_session_registers_again_after_known_for_s(
    redis_server: RedisServer, namespace: str
) -> None:
    """Upserts written behind answer briefly and confirm nothing: a session that keeps
    repeating registers synchronously again once ``known_for_s`` has passed (and reads what
    Redis has then), its repeats in between answered from memory."""
    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.known is not None and rt.store is not None
        rt.known.known_for_s = 0.3
        store, registered = rt.store, []
        upsert = store.upsert

        async def counted(*args: Any) -> Any:
            registered.append(time.monotonic())
            return await upsert(*args)

        setattr(store, "upsert", counted)  # noqa: B010
        async with asyncio.timeout(10):
            assert await _post(st, _hinted("r")) == (200, "accepted")
            while len(registered) < 2:  # repeats until one registers synchronously again
                assert await _post(st, _hinted("r")) == (200, "accepted")
                await rt.settle()  # its upsert written behind, answered briefly
                await asyncio.sleep(0.02)
        # not before known_for_s; soon after it (the bound leaves room for a loaded machine)
        assert len(registered) == 2 and 0.3 <= registered[1] - registered[0] < 1.0
        assert rt.known.repeats > 5
