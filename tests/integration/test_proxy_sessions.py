"""The session plane through the proxy: dialects stripped, Redis state, trees, tenants, failures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from proxy.settings import Limits
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN_HEADERS, Stack, proxy_stack

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "a long shared system prompt " * 20}],
}


async def _chat(
    st: Stack,
    body: dict[str, object] | None = None,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
):  # type: ignore[no-untyped-def]
    resp = await st.client.post(path, json=body or CHAT, headers=headers or {})
    await resp.read()
    return resp


async def _session(st: Stack, sid: str, min_prompt: int = 1) -> dict[str, object]:
    for _ in range(100):  # completion is recorded off the hot path
        resp = await st.client.get(f"/admin/sessions/{sid}", headers=ADMIN_HEADERS)
        body = await resp.json()
        if resp.status == 200 and body["counters"]["prompt_tokens"] >= min_prompt:
            return dict(body)
        await asyncio.sleep(0.02)
    return dict(body)


async def test_every_dialect_is_stripped_before_the_engine(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        hint = {
            "session_id": "w1",
            "parent_session_id": "lead",
            "cache_control": {"type": "ephemeral", "ttl": 120},
        }
        r = await _chat(
            st,
            {
                **CHAT,
                "agent_hint": hint,
                "prompt_cache_key": "w1",
                "prompt_cache_retention": "in_memory",
            },
            {"X-Session-Id": "w1", "X-Agent-Name": "coder", "X-Cache-TTL": "60"},
        )
        assert r.status == 200 and r.headers["X-KVKeeper-Hint"] == "accepted"
        sent = st.engine.received[-1]
        assert sent.json == CHAT
        for h in ("X-Session-Id", "X-Agent-Name", "X-Cache-TTL"):
            assert h not in sent.headers
        anthropic = {
            "model": "fake-model",
            "max_tokens": 4,
            "system": [
                {"type": "text", "text": "sys", "cache_control": {"type": "ephemeral", "ttl": "5m"}}
            ],
            "messages": [{"role": "user", "content": "q"}],
        }
        r = await _chat(st, anthropic, path="/v1/messages")
        assert r.status == 200 and r.headers["X-KVKeeper-Hint"] == "accepted"
        assert b"cache_control" not in st.engine.received[-1].body
        metrics = await (await st.client.get("/metrics")).text()
        for dialect in ("agent_hint", "headers", "openai", "anthropic"):
            assert f'kvkeeper_hints_total{{dialect="{dialect}"}} 1.0' in metrics


async def test_session_counters_tree_and_ttl(redis_server: RedisServer, namespace: str) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        hint = {"session_id": "w1", "parent_session_id": "lead", "cache_control": {"ttl": 120}}
        await _chat(st, {**CHAT, "agent_hint": hint}, {"X-Agent-Name": "coder"})
        await _chat(st, {**CHAT, "agent_hint": hint})
        # the fake engine reports prompt = chars/4 and cached = shared prefix/4 on the repeat
        prompt = len(json.dumps(CHAT["messages"])) // 4
        s = await _session(st, "w1", min_prompt=2 * prompt)
        counters = s["counters"]
        assert isinstance(counters, dict)
        assert counters["requests"] == 2 and counters["prompt_tokens"] == 2 * prompt
        assert counters["cached_tokens"] == prompt
        assert (
            s["parent_session_id"] == "lead"
            and s["agent"] == "coder"
            and s["engine"] == st.engine.url.split("//")[1]
        )
        assert 100 < float(s["ttl_left_s"]) <= 120 and s["state"] == "protected"
        assert int(s["context_bytes"]) > 0
        lead = await (await st.client.get("/admin/sessions/lead", headers=ADMIN_HEADERS)).json()
        assert lead["children"] == ["w1"] and lead["tree"]["children"][0]["session_id"] == "w1"
        listed = await (
            await st.client.get("/admin/sessions", headers=ADMIN_HEADERS, params={"parent": "lead"})
        ).json()
        assert [x["session_id"] for x in listed["data"]] == ["w1"]
        # ttl 0 stops protection
        await _chat(st, {**CHAT, "agent_hint": {"session_id": "w1", "cache_control": {"ttl": 0}}})
        for _ in range(50):
            s = await (await st.client.get("/admin/sessions/w1", headers=ADMIN_HEADERS)).json()
            if s["state"] == "idle":
                break
            await asyncio.sleep(0.02)
        assert s["state"] == "idle" and s["ttl_left_s"] == 0


async def test_invalid_hint_is_400_and_changes_nothing(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        bad = {
            **CHAT,
            "agent_hint": {
                "session_id": "s",
                "context_management": {"edits": [{"type": "evict", "block_start": 4}]},
            },
        }
        r = await st.client.post("/v1/chat/completions", json=bad)
        body = await r.json()
        assert r.status == 400 and body["error"]["type"] == "invalid_request_error"
        assert "supplied together" in body["error"]["message"]
        assert st.engine.received == []
        metrics = await (await st.client.get("/metrics")).text()
        assert 'kvkeeper_requests_total{route="/v1/chat/completions",status="400"} 1.0' in metrics
        client = aioredis.Redis.from_url(redis_server.url)
        keys = [k async for k in client.scan_iter(f"{namespace}:*")]
        assert [k for k in keys if b":lease:" not in k and b":fence:" not in k] == []
        await client.aclose()


async def test_free_tree_children_first_and_single_free(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        for sid, parent in (("root", None), ("a", "root"), ("b", "root"), ("a1", "a"), ("a2", "a")):
            hint: dict[str, object] = {"session_id": sid}
            if parent:
                hint["parent_session_id"] = parent
            assert (await _chat(st, {**CHAT, "agent_hint": hint})).status == 200
        r = await st.client.delete(
            "/admin/sessions/a", headers=ADMIN_HEADERS, params={"tree": "true"}
        )
        freed = (await r.json())["freed"]
        assert sorted(freed[:2]) == ["a1", "a2"] and freed[2] == "a"
        root = await (await st.client.get("/admin/sessions/root", headers=ADMIN_HEADERS)).json()
        assert root["children"] == ["b"]
        r = await st.client.delete(
            "/admin/sessions/root", headers=ADMIN_HEADERS, params={"tree": "true"}
        )
        assert (await r.json())["freed"] == ["b", "root"]
        assert (await st.client.get("/admin/sessions/b", headers=ADMIN_HEADERS)).status == 404
        assert (await st.client.delete("/admin/sessions/root", headers=ADMIN_HEADERS)).status == 404


async def test_tenant_isolation(redis_server: RedisServer, namespace: str, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  team-a: {api_keys: [key-a]}\n  team-b: {api_keys: [key-b]}\n")
    async with proxy_stack(redis_server.url, namespace, tenants_file=tenants) as st:
        assert (await _chat(st, CHAT)).status == 401
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        assert (await _chat(st, {**CHAT, "agent_hint": {"session_id": "same"}}, a)).status == 200
        assert "Authorization" not in st.engine.received[-1].headers  # the tenant key stays here
        assert (await _chat(st, {**CHAT, "agent_hint": {"session_id": "only-b"}}, b)).status == 200
        # tenant A sees its own session only; B cannot see or free A's
        listed = await (await st.client.get("/admin/sessions", headers=a)).json()
        assert [x["session_id"] for x in listed["data"]] == ["same"]
        assert (await st.client.get("/admin/sessions/same", headers=b)).status == 404
        assert (await st.client.delete("/admin/sessions/same", headers=b)).status == 404
        assert (
            await st.client.get("/admin/sessions", headers=b, params={"tenant": "team-a"})
        ).status == 403
        assert (await st.client.get("/admin/sessions/same", headers=a)).status == 200
        # the operator sees both tenants
        every = await (await st.client.get("/admin/sessions", headers=ADMIN_HEADERS)).json()
        assert sorted(x["tenant"] for x in every["data"]) == ["team-a", "team-b"]
        assert (
            await st.client.get("/admin/sessions", headers={"Authorization": "Bearer nope"})
        ).status == 401


async def test_bounds_reject_hint_but_forward_request(
    redis_server: RedisServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Limits, "max_children", 1)
    async with proxy_stack(redis_server.url, namespace, max_sessions_per_tenant=2) as st:
        for sid in ("s1", "s2"):
            assert (await _chat(st, {**CHAT, "agent_hint": {"session_id": sid}})).headers[
                "X-KVKeeper-Hint"
            ] == "accepted"
        r = await _chat(st, {**CHAT, "agent_hint": {"session_id": "s3"}})
        assert r.status == 200 and r.headers["X-KVKeeper-Hint"] == "rejected; reason=max_sessions"
        assert (await st.client.get("/admin/sessions/s3", headers=ADMIN_HEADERS)).status == 404
        r = await _chat(st, {**CHAT, "agent_hint": {"session_id": "s2", "parent_session_id": "s1"}})
        assert r.headers["X-KVKeeper-Hint"] == "accepted"
        await _chat(st, {**CHAT, "agent_hint": {"session_id": "s1", "parent_session_id": "s2"}})
        r = await _chat(
            st, {**CHAT, "agent_hint": {"session_id": "s2", "parent_session_id": "other"}}
        )
        assert r.headers["X-KVKeeper-Hint"] in (
            "rejected; reason=parent_mismatch",
            "rejected; reason=max_sessions",
        )


async def test_manage_request_never_reaches_the_model(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        manage = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": ""}],
            "agent_hint": {
                "session_id": "w",
                "context_management": {
                    "manage_request": True,
                    "edits": [
                        {"type": "prefetch"},
                        {"type": "evict", "block_start": 0, "block_end": 2},
                    ],
                },
            },
        }
        r = await st.client.post("/v1/chat/completions", json=manage)
        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_session"
        await _chat(st, {**CHAT, "agent_hint": {"session_id": "w"}})
        n = len(st.engine.received)
        r = await st.client.post("/v1/chat/completions", json=manage)
        body = await r.json()
        assert r.status == 200 and body["object"] == "kvkeeper.management"
        assert [x["type"] for x in body["results"]] == ["prefetch", "evict"]
        assert all(
            x["status"] in ("applied", "unsupported", "rejected", "failed") for x in body["results"]
        )
        assert body["results"][1]["block_start"] == 0 and body["results"][1]["block_end"] == 2
        # the management body itself never reaches the engine; a prefetch is realized by one
        # warm-up (max_tokens 1) over the session's recorded context
        assert body["results"][0]["status"] == "applied"
        extra = [r.json for r in st.engine.received[n:]]
        assert extra == [{**CHAT, "max_tokens": 1}]


async def test_redis_killed_mid_run_traffic_still_flows(namespace: str) -> None:
    own = RedisServer().start()
    try:
        async with proxy_stack(own.url, namespace) as st:
            assert (await _chat(st, {**CHAT, "agent_hint": {"session_id": "s"}})).headers[
                "X-KVKeeper-Hint"
            ] == "accepted"
            own.stop()
            for _ in range(5):
                r = await _chat(st, {**CHAT, "agent_hint": {"session_id": "s"}})
                assert r.status == 200
                assert r.headers["X-KVKeeper-Hint"] == "rejected; reason=store_unavailable"
            assert (await _chat(st)).status == 200
            assert (await st.client.get("/admin/sessions", headers=ADMIN_HEADERS)).status == 503
            manage = {
                **CHAT,
                "agent_hint": {
                    "session_id": "s",
                    "context_management": {"manage_request": True, "edits": [{"type": "evict"}]},
                },
            }
            assert (await st.client.post("/v1/chat/completions", json=manage)).status == 503
            metrics = await (await st.client.get("/metrics")).text()
            assert (
                "kvkeeper_fail_open_requests_total" in metrics
                and "kvkeeper_redis_errors_total 0.0" not in metrics
            )
            assert len(st.engine.received) == 7
            own.start()  # Redis comes back on the same port: sessions work again after the cooldown
            await asyncio.sleep(1.1)
            r = await _chat(st, {**CHAT, "agent_hint": {"session_id": "s2"}})
            assert r.headers["X-KVKeeper-Hint"] == "accepted"
    finally:
        own.stop()


async def test_restart_keeps_sessions(redis_server: RedisServer, namespace: str) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        await _chat(
            st, {**CHAT, "agent_hint": {"session_id": "durable", "cache_control": {"ttl": 600}}}
        )
        before = await _session(st, "durable")
    async with proxy_stack(redis_server.url, namespace) as st2:
        after = await (
            await st2.client.get("/admin/sessions/durable", headers=ADMIN_HEADERS)
        ).json()
        assert after["counters"] == before["counters"] and after["state"] == "protected"


async def test_openapi_matches_routes(redis_server: RedisServer, namespace: str) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        doc = await (await st.client.get("/openapi.json")).json()
        documented = {(p, m.upper()) for p, ops in doc["paths"].items() for m in ops}
        routed = {
            (r.resource.canonical, r.method)
            for r in st.client.app.router.routes()
            if r.method != "HEAD" and r.resource is not None
        }
        assert documented == routed


async def test_running_children_keep_their_parent_protected(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        await _chat(
            st, {**CHAT, "agent_hint": {"session_id": "lead", "cache_control": {"ttl": 1.0}}}
        )
        for _ in range(4):  # 1.6 s of child activity: longer than the parent's own 1 s TTL
            await asyncio.sleep(0.4)
            await _chat(
                st, {**CHAT, "agent_hint": {"session_id": "w", "parent_session_id": "lead"}}
            )
        lead = await (await st.client.get("/admin/sessions/lead", headers=ADMIN_HEADERS)).json()
        assert lead["state"] in ("protected", "active") and 0.5 < lead["ttl_left_s"] <= 1.0
        await asyncio.sleep(1.2)  # children stopped: the parent's TTL runs out on its own
        lead = await (await st.client.get("/admin/sessions/lead", headers=ADMIN_HEADERS)).json()
        assert lead["ttl_left_s"] == 0
