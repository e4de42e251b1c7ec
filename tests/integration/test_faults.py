"""Regression tests for the faults of issue 29 (each failed before its fix)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from proxy.settings import Limits
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN_HEADERS, Stack, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello " * 20}]}
TENANTS = "tenants:\n  team-a: {api_keys: [key-a]}\n  team-b: {api_keys: [key-b]}\n"
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


async def raw_http(
    st: Stack, request: bytes, timeout_s: float = 5.0, until: bytes | None = None
) -> bytes:
    """Send raw bytes to the proxy (headers aiohttp's client would refuse to send); everything
    it answers until it closes the connection, or until ``until`` arrives (``timeout_s`` at
    most)."""
    reader, writer = await asyncio.open_connection(st.client.host, st.client.port)
    try:
        writer.write(request)
        await writer.drain()
        if until is None:
            return await asyncio.wait_for(reader.read(-1), timeout_s)
        got = b""
        async with asyncio.timeout(timeout_s):
            while until not in got:
                more = await reader.read(65536)
                if not more:
                    break
                got += more
        return got
    finally:
        writer.close()


def _chat_bytes(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer key-a\r\nConnection: close\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


async def test_invalid_ids_are_400_and_never_fail_another_tenant(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    async with proxy_stack(redis_server.url, namespace, tenants_file=tenants) as st:
        good_body = b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]'
        bad = [
            _chat_bytes(good_body + b',"agent_hint":{"session_id":"evil\\ud800"}}'),
            _chat_bytes(good_body + b',"prompt_cache_key":"evil\\udfff"}'),
            _chat_bytes(
                good_body + b',"agent_hint":{"session_id":"ok","parent_session_id":"p\\ud800"}}'
            ),
            _chat_bytes(good_body + b"}", b"X-Session-Id: evil\xff\xfe\r\n"),
            _chat_bytes(good_body + b"}", b"X-Session-Id: s1\r\nX-Agent-Name: a\xc3\x28\r\n"),
        ]

        async def good(i: int) -> int:
            body = {**CHAT, "agent_hint": {"session_id": f"b-{i % 50}"}}
            resp = await st.client.post("/v1/chat/completions", json=body, headers=B)
            await resp.read()
            return resp.status

        async def evil(i: int) -> bytes:
            return await raw_http(st, bad[i % len(bad)])

        results = await asyncio.gather(
            *(good(i) for i in range(200)), *(evil(i) for i in range(40))
        )
        statuses = results[:200]
        assert statuses == [200] * 200  # none of tenant B's requests failed
        for answer in results[200:]:
            assert isinstance(answer, bytes)
            assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
            assert b'"invalid_request_error"' in answer and b'"invalid_hint"' in answer
        # nothing of tenant A reached Redis
        listed = await (await st.client.get("/admin/sessions", headers=A)).json()
        assert listed["data"] == []
        # a surrogate elsewhere in the body is forwarded (escaped), not a 500
        body = good_body[:-1] + b'"\\ud800x"}],"prompt_cache_key":"fine"}'
        answer = await raw_http(st, _chat_bytes(body.replace(b'"hi"}]', b'"hi"},')))
        assert answer.startswith(b"HTTP/1.1 "), answer
        assert not answer.startswith(b"HTTP/1.1 500"), answer[:300]


async def _post(st: Stack, path: str, data: bytes, headers: dict[str, str] | None = None) -> Any:
    resp = await st.client.post(path, data=data, headers=headers or {})
    return resp.status, await resp.json()


async def test_deeply_nested_json_is_400(redis_server: RedisServer, namespace: str) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        deep = b'{"agent_hint":{"session_id":"s"},"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, body = await _post(st, "/v1/chat/completions", deep)
        assert status == 400 and body["error"]["code"] == "invalid_json"
        # the admin API's JSON bodies too
        await _post(st, "/v1/chat/completions", b'{"model":"m","prompt_cache_key":"s"}')
        status, body = await _post(
            st, "/admin/sessions/s/pin", b"[" * 100_000 + b"]" * 100_000, ADMIN_HEADERS
        )
        assert status == 400, body


async def test_malformed_cursor_is_400(redis_server: RedisServer, namespace: str) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        await _post(st, "/v1/chat/completions", b'{"model":"m","prompt_cache_key":"s"}')
        for cursor in ("x", "1", "-1:0", "0:-3", "0:1:2", "9" * 40 + ":0", "0:" + "9" * 40):
            resp = await st.client.get(
                "/admin/sessions", params={"cursor": cursor}, headers=ADMIN_HEADERS
            )
            assert resp.status == 400, (cursor, await resp.text())
            assert (await resp.json())["error"]["param"] == "cursor"


@pytest.mark.parametrize("mode", ["die", "stall"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_engine_failing_mid_stream_ends_the_stream_cleanly(
    redis_server: RedisServer, namespace: str, mode: str, path: str
) -> None:
    async with proxy_stack(
        redis_server.url,
        namespace,
        engine_factory=lambda i: FakeEngine(
            name=f"e{i}", n_chunks=5, fail_after_chunks=2, fail_mode=mode
        ),
        overrides={"upstream": {"stream_stall_timeout_s": 0.5}},
    ) as st:
        body = b'{"model":"fake-model","stream":true,"messages":[{"role":"user","content":"hi"}],"prompt_cache_key":"s1"}'
        request = (
            b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (path.encode(), len(body), body)
        )
        started = asyncio.get_running_loop().time()
        # the client keeps its connection open (keep-alive): the proxy must close it
        answer = await raw_http(st, request, timeout_s=5.0)
        elapsed = asyncio.get_running_loop().time() - started
        assert elapsed < 3.0
        assert answer.count(b"HTTP/1.1 ") == 1, answer  # never a second response in the body
        assert answer.startswith(b"HTTP/1.1 200")
        assert b"Transfer-Encoding: chunked" in answer
        assert answer.endswith(b"0\r\n\r\n")  # the chunked body ends cleanly
        assert b"tok0" in answer and b"tok2" not in answer
        if path == "/v1/messages":
            assert b"event: error\r\n" not in answer and b"event: error" in answer
            assert b'"type":"api_error"' in answer
        else:
            assert b'"code":"engine_failed"' in answer


async def test_body_size_and_read_timeouts(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Limits, "body_timeout_s", 0.5)
    async with proxy_stack(
        redis_server.url, namespace, max_body_bytes=4096, header_timeout_s=0.5
    ) as st:
        loop = asyncio.get_running_loop()
        # a declared size over the cap: 413 at once, the body never read (nor sent here)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n"
        started = loop.time()
        answer = await raw_http(st, head + b"\r\n", timeout_s=3.0, until=b"}}")
        assert answer.startswith(b"HTTP/1.1 413") and b'"body_too_large"' in answer
        assert loop.time() - started < 1.0
        # a chunked body that grows past the cap while read: 413
        chunked = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"1000\r\n" + b"x" * 4096 + b"\r\n"
        answer = await raw_http(st, chunked + chunk * 3 + b"0\r\n\r\n", 3.0, until=b"}}")
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        # a body that stops arriving: 408 after body_timeout_s, and the connection closes
        started = loop.time()
        answer = await raw_http(
            st,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Length: 100\r\n\r\n{"model":',
            timeout_s=5.0,
            until=b"}}",
        )
        assert answer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in answer
        assert 0.4 < loop.time() - started < 3.0
        # slowloris: headers never finished -> the connection is closed after header_timeout_s
        started = loop.time()
        conns = [await asyncio.open_connection(st.client.host, st.client.port) for _ in range(20)]
        for _, writer in conns:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-a: ")
        for reader, writer in conns:
            assert await asyncio.wait_for(reader.read(-1), 5.0) == b""  # closed by the proxy
            writer.close()
        assert loop.time() - started < 3.0
        assert st.engine.received == []
        # ordinary requests are unaffected
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200


async def test_inflight_body_budget(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Limits, "max_inflight_body_bytes", 6000)
    async with proxy_stack(redis_server.url, namespace, max_body_bytes=4096) as st:
        # one body half sent holds 4000 bytes of the budget: a second one does not fit
        _, writer = await asyncio.open_connection(st.client.host, st.client.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{"
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        resp = await st.client.post("/v1/chat/completions", data=b"x" * 3000)
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "server_busy"
        writer.close()
        await asyncio.sleep(0.2)
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200


async def test_failed_upstream_request_registers_no_session(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        body = {"model": "error", "messages": [], "agent_hint": {"session_id": "never"}}
        resp = await st.client.post("/v1/chat/completions", json=body)
        assert resp.status == 400
        assert resp.headers["X-KVKeeper-Hint"].startswith("rejected; reason=upstream_status_400")
        for _ in range(50):
            got = await st.client.get("/admin/sessions/never", headers=ADMIN_HEADERS)
            if got.status == 404:
                break
            await asyncio.sleep(0.02)
        assert got.status == 404
        listed = await (await st.client.get("/admin/sessions", headers=ADMIN_HEADERS)).json()
        assert listed["data"] == []
        # a session that served a request before is kept when a later request fails
        ok = {**CHAT, "agent_hint": {"session_id": "kept"}}
        assert (await st.client.post("/v1/chat/completions", json=ok)).status == 200
        bad = {**body, "agent_hint": {"session_id": "kept"}}
        assert (await st.client.post("/v1/chat/completions", json=bad)).status == 400
        await asyncio.sleep(0.2)
        assert (await st.client.get("/admin/sessions/kept", headers=ADMIN_HEADERS)).status == 200


async def test_a_not_ready_engine_gets_no_new_requests(
    redis_server: RedisServer, namespace: str
) -> None:
    from proxy.runtime import RUNTIME

    async with proxy_stack(
        redis_server.url, namespace, engine_factory=lambda i: FakeEngine(name="e", hung=True)
    ) as st:
        rt = st.client.app[RUNTIME]
        assert await rt.pool.check(rt.pool.engines[0]) is False  # its health check times out
        loop = asyncio.get_running_loop()
        started = loop.time()
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_unavailable"
        assert loop.time() - started < 5.0  # one more health check (3 s timeout), not 600 s
        assert st.engine.received == []


async def test_engine_addresses_only_for_the_admin(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 200 and "X-KVKeeper-Engine" not in resp.headers
        ready = await (await st.client.get("/readyz")).json()
        assert "engines" not in ready and ready["engines_ready"] == 1
        resp = await st.client.post("/v1/chat/completions", json=CHAT, headers=ADMIN_HEADERS)
        assert resp.headers["X-KVKeeper-Engine"] == st.engine.url.removeprefix("http://")
        ready = await (await st.client.get("/readyz", headers=ADMIN_HEADERS)).json()
        assert list(ready["engines"].values()) == [True]
    async with proxy_stack(redis_server.url, namespace, overrides={"expose_engines": True}) as st:
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        assert "X-KVKeeper-Engine" in resp.headers
        assert "engines" in await (await st.client.get("/readyz")).json()


async def test_lease_fence_never_goes_backwards_when_redis_loses_its_data(
    redis_server: RedisServer, namespace: str
) -> None:
    import redis.asyncio as aioredis

    from proxy.settings import Limits
    from proxy.store import SessionStore

    redis = aioredis.Redis.from_url(redis_server.url)
    store = SessionStore(redis, Limits(), namespace=namespace)
    try:
        first = await store.lease("engine:x", "a", 200)
        await redis.delete(f"{namespace}:lease:engine:x")
        second = await store.lease("engine:x", "b", 200)
        assert second > first > 0
        await redis.flushdb()  # Redis lost everything (no persistence, restarted)
        third = await store.lease("engine:x", "c", 200)
        assert third > second
    finally:
        await store.aclose()
        await redis.aclose()
