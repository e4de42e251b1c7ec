"""Accounting whatever the client asks: streams without include_usage still count their usage,
and the client receives exactly the engine's answer to what it sent."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.helpers.redis_server import RedisServer, free_port
from tests.integration.proxy_fixtures import ADMIN_HEADERS, Stack, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "count me " * 40}]}


async def _direct(url: str, path: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return await r.read()


async def _counters(st: Stack, sid: str) -> dict[str, int]:
    for _ in range(100):  # completions are written off the hot path
        resp = await st.client.get(f"/admin/sessions/{sid}", headers=ADMIN_HEADERS)
        if resp.status == 200:
            counters: dict[str, int] = (await resp.json())["counters"]
            if counters.get("prompt_tokens"):
                return counters
        await asyncio.sleep(0.02)
    raise AssertionError(f"session {sid} never counted its usage")


async def test_stream_without_include_usage_counts_and_relays_the_engines_bytes(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        for path, body in (
            ("/v1/chat/completions", {**CHAT, "stream": True}),
            ("/v1/completions", {"model": "fake-model", "prompt": "abc " * 50, "stream": True}),
        ):
            direct = await _direct(st.engine.url, path, body)
            assert b'"usage"' not in direct
            st.engine.prompts.clear()
            sid = f"s{len(path)}"
            resp = await st.client.post(path, json=body, headers={"X-Session-Id": sid})
            proxied = await resp.read()
            st.engine.prompts.clear()
            assert resp.status == 200 and proxied == direct, path
            # the engine was asked for usage; the client never sees it
            sent = st.engine.received[-1].json
            assert sent["stream_options"] == {"include_usage": True}
            assert {k: v for k, v in sent.items() if k != "stream_options"} == body
            counters = await _counters(st, sid)
            assert counters["prompt_tokens"] > 40 and counters["requests"] == 1
        # a client that asks for usage itself gets it, untouched
        asked = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        direct = await _direct(st.engine.url, "/v1/chat/completions", asked)
        st.engine.prompts.clear()
        resp = await st.client.post("/v1/chat/completions", json=asked)
        assert await resp.read() == direct and b'"usage"' in direct


async def test_errors_on_messages_routes_are_anthropic_shaped(
    redis_server: RedisServer, namespace: str
) -> None:
    msg = {"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    bad_hint = {**msg, "agent_hint": {"session_id": 5}}
    async with proxy_stack(redis_server.url, namespace) as st:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            resp = await st.client.post(path, json=bad_hint)
            assert resp.status == 400
            body = await resp.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert "session_id" in body["error"]["message"] and set(body["error"]) == {
                "type",
                "message",
            }
        # the OpenAI routes keep the OpenAI shape
        resp = await st.client.post("/v1/chat/completions", json={**CHAT, **bad_hint})
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_hint"
    dead = f"http://127.0.0.1:{free_port()}"
    async with proxy_stack(
        redis_server.url, namespace, n_engines=0, extra_engine_urls=[dead]
    ) as st:
        resp = await st.client.post("/v1/messages", json=msg)
        # 502 when the connection fails, 503 once the start-up health check marked it not ready
        assert resp.status in (502, 503)
        body = await resp.json()
        kind = {502: "api_error", 503: "overloaded_error"}[resp.status]
        assert body["type"] == "error" and body["error"]["type"] == kind
        assert "no engine" in body["error"]["message"]


async def test_a_failed_request_leaves_an_existing_session_as_it_was(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        for sid, ttl in (("plain", None), ("kept", 300)):
            hint: dict[str, Any] = {"session_id": sid}
            if ttl is not None:
                hint["cache_control"] = {"type": "ephemeral", "ttl": ttl}
            ok = await st.client.post("/v1/chat/completions", json={**CHAT, "agent_hint": hint})
            assert ok.status == 200
            await ok.read()
            before = await _counters(st, sid)
            failed = await st.client.post(
                "/v1/chat/completions",
                json={**CHAT, "model": "error", "agent_hint": {"session_id": sid}},
            )
            assert failed.status == 400
            assert failed.headers["X-KVKeeper-Hint"] == "rejected; reason=upstream_status_400"
            want = "idle" if ttl is None else "protected"
            for _ in range(100):  # the failure is settled off the hot path
                got = await st.client.get(f"/admin/sessions/{sid}", headers=ADMIN_HEADERS)
                session = await got.json()
                if session["state"] == want:
                    break
                await asyncio.sleep(0.02)
            assert session["state"] == want, session
            assert session["counters"]["prompt_tokens"] == before["prompt_tokens"]
