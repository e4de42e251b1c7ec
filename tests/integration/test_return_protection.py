"""A session back without a TTL hint is protected for the learned return window
(policy/returns.py, wired in proxy/runtime.py): its first return teaches the window, and
sessions with a TTL of their own, or on their first request, are left as they asked. The guess
is marked as one (ranked after clients' TTLs where retention rations) until the client asks a
TTL of its own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from policy import ReturnWindow, ReturnWindowConfig
from proxy.runtime import RUNTIME, Runtime
from proxy.sessions_format import show_text
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN_HEADERS, Stack, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello " * 40}]}


def _body(sid: str, ttl: float | None = None) -> dict[str, Any]:
    hint: dict[str, Any] = {"session_id": sid}
    if ttl is not None:
        hint["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return {**CHAT, "agent_hint": hint}


async def _post(st: Stack, body: dict[str, Any]) -> None:
    resp = await st.client.post("/v1/chat/completions", json=body)
    await resp.read()
    assert resp.status == 200


def _rt(st: Stack) -> Runtime:
    app = st.client.app
    assert app is not None
    rt: Runtime = app[RUNTIME]
    return rt


async def test_a_returning_session_is_protected_for_the_learned_window(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.store is not None and rt.returns is not None  # on by default
        assert rt.returns.config.factor == 2.0
        rt.returns = ReturnWindow(ReturnWindowConfig(factor=3.0, min_samples=1, min_ttl_s=30.0))
        await _post(st, _body("chat"))
        await _post(st, _body("tool", ttl=90.0))
        await rt.settle()
        first = await rt.store.get("default", "chat")
        assert first is not None and first.ttl_until == 0  # a first request: nothing known
        await asyncio.sleep(0.2)
        start = time.time()
        await _post(st, _body("chat"))
        await _post(st, _body("tool", ttl=90.0))
        await rt.drain()
        await rt.settle()
        back = await rt.store.get("default", "chat")
        assert back is not None and rt.returns.samples == 1  # the TTL-hinted one taught nothing
        assert back.state == "protected"
        assert start + 29.0 <= back.ttl_until <= time.time() + 31.0  # 3 x 0.2 s, at least 30 s
        tool = await rt.store.get("default", "tool")
        assert tool is not None and tool.ttl_until <= time.time() + 91.0  # its own TTL
        assert back.guessed and not tool.guessed
        mirrored = {s.session_id: s for s in await rt.store.protected(time.time())}
        assert mirrored["chat"].guessed and not mirrored["tool"].guessed  # what retention reads
        for sid, guessed in (("chat", True), ("tool", False)):  # what an operator reads
            record = await (
                await st.client.get(f"/admin/sessions/{sid}", headers=ADMIN_HEADERS)
            ).json()
            detail = await st.client.get(f"/admin/console/sessions/{sid}", headers=ADMIN_HEADERS)
            shown = (await detail.json())["session"]
            assert record["ttl_guessed"] is guessed and shown["ttl_guessed"] is guessed
            assert ("guessed from its returns" in show_text(record, time.time())) is guessed
        await _post(st, _body("chat"))  # a later return is protected but teaches nothing
        await rt.drain()
        assert rt.returns.samples == 1
        await _post(st, _body("chat", ttl=60.0))  # the client's own TTL: no longer a guess
        await rt.settle()
        asked = await rt.store.get("default", "chat")
        assert asked is not None and not asked.guessed
        record = await (await st.client.get("/admin/sessions/chat", headers=ADMIN_HEADERS)).json()
        assert record["ttl_guessed"] is False
        mirrored = {s.session_id: s for s in await rt.store.protected(time.time())}
        assert not mirrored["chat"].guessed


async def test_off_at_factor_zero(redis_server: RedisServer, namespace: str) -> None:
    overrides = {"retention": {"return_ttl_factor": 0}}
    async with proxy_stack(redis_server.url, namespace, overrides=overrides) as st:
        rt = _rt(st)
        assert rt.returns is None and rt.store is not None
        for _ in range(2):
            await _post(st, _body("chat"))
        await rt.settle()
        session = await rt.store.get("default", "chat")
        assert session is not None and session.ttl_until == 0


async def test_a_repeat_while_still_protected_sends_no_protect(
    redis_server: RedisServer, namespace: str
) -> None:
    """Every return used to send a protect; one while most of the window this process set
    is still ahead sends nothing, one after the window ran out (or after a TTL hint) does."""
    async with proxy_stack(redis_server.url, namespace) as st:
        rt = _rt(st)
        assert rt.store is not None
        rt.returns = ReturnWindow(ReturnWindowConfig(factor=1.0, min_samples=1, min_ttl_s=1.0))
        sent: list[float] = []
        protect = rt.store.protect

        async def counted(tenant: str, sid: str, now: float, ttl_s: float, **kw: Any) -> bool:
            sent.append(ttl_s)
            return await protect(tenant, sid, now, ttl_s, **kw)

        setattr(rt.store, "protect", counted)  # noqa: B010
        await _post(st, _body("chat"))
        await rt.settle()
        await asyncio.sleep(0.05)
        async with asyncio.timeout(10):
            await _post(st, _body("chat"))  # its first return: protected for 1 s
            await rt.drain()
            assert sent == [1.0]
            for _ in range(3):  # returns within the window just set: nothing to send
                await _post(st, _body("chat"))
            await rt.drain()
            assert sent == [1.0]
            await asyncio.sleep(1.05)  # the window ran out: the next return protects again
            start = time.time()
            await _post(st, _body("chat"))
            await rt.drain()
            assert sent == [1.0, 1.0]
            await rt.settle()
            back = await rt.store.get("default", "chat")
            assert back is not None and back.state == "protected"
            assert start + 0.9 <= back.ttl_until <= time.time() + 1.1
            await _post(st, _body("chat", ttl=0))  # stop protecting: its own TTL decides
            await _post(st, _body("chat"))  # back without a TTL: protected again at once
            await rt.drain()
            assert sent == [1.0, 1.0, 1.0]
