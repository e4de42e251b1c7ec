"""``GET /admin/sessions`` paging: every session exactly once while the tenant's sessions are
busy (each finished request moves its session in the activity index), and cursor validation."""

from __future__ import annotations

import asyncio
import base64
import json
import random
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from proxy.runtime import RUNTIME
from tests.helpers.redis_server import RedisServer
from tests.integration.proxy_fixtures import ADMIN_HEADERS, Stack, proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "shared prefix " * 8}]}
TENANTS = "tenants:\n  team-a: {api_keys: [key-a]}\n  team-b: {api_keys: [key-b]}\n"
KEY = {"team-a": {"Authorization": "Bearer key-a"}, "team-b": {"Authorization": "Bearer key-b"}}


async def _use(st: Stack, tenant: str, sid: str, parent: str | None = None) -> None:
    hint = {"session_id": sid, **({"parent_session_id": parent} if parent else {})}
    resp = await st.client.post(
        "/v1/chat/completions", json={**CHAT, "agent_hint": hint}, headers=KEY[tenant]
    )
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-KVKeeper-Hint"].startswith("accepted"), resp.headers
    await resp.read()


async def _get(st: Stack, headers: dict[str, str], **params: str) -> tuple[int, Any]:
    resp = await st.client.get("/admin/sessions", params=params, headers=headers)
    return resp.status, await resp.json()


async def _page_all(
    st: Stack, headers: dict[str, str], between: Any = None, **params: str
) -> list[tuple[str, str]]:
    """Follow next_cursor to the end; ``between`` runs after each page."""
    listed: list[tuple[str, str]] = []
    cursor: str | None = None
    while True:
        status, page = await _get(st, headers, **params, **({"cursor": cursor} if cursor else {}))
        assert status == 200, page
        listed += [(s["tenant"], s["session_id"]) for s in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return listed
        if between is not None:
            await between()


async def test_paging_while_sessions_are_used_lists_each_exactly_once(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    n = 30
    sids = {t: [f"s-{i:03d}" for i in range(n)] for t in KEY}
    # sessions used again stay idle (no return protection): the state filter pages the idle
    no_returns = {"retention": {"return_ttl_factor": 0}}
    async with proxy_stack(
        redis_server.url, namespace, tenants_file=tenants, overrides=no_returns
    ) as st:
        for tenant, ids in sids.items():
            for sid in ids:
                await _use(st, tenant, sid)
        rt = st.client.app[RUNTIME]
        await rt.settle()
        r = aioredis.from_url(redis_server.url)
        index = f"{namespace}:idx:team-a"
        used, done = 0, asyncio.Condition()

        async def churn() -> None:  # requests on random sessions of team-a, forever
            nonlocal used
            rng = random.Random(7)
            while True:
                await _use(st, "team-a", rng.choice(sids["team-a"]))
                async with done:
                    used += 1
                    done.notify_all()

        orders: list[tuple[Any, ...]] = []

        async def between() -> None:
            """Let a few requests finish and land in the activity index before the next page."""
            target = used + 3
            async with done:
                await done.wait_for(lambda: used >= target)
            await rt.settle()
            orders.append(tuple(await r.zrevrange(index, 0, -1)))

        task = asyncio.create_task(churn())
        try:
            # the tenant's own key, then the operator over every tenant (cursor crosses tenants)
            mine = await _page_all(st, KEY["team-a"], between, limit="4")
            every = await _page_all(st, ADMIN_HEADERS, between, limit="7")
            # a filter that every session passes still pages by id
            idle = await _page_all(st, KEY["team-a"], between, limit="5", state="idle")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await r.aclose()
        assert len(set(orders)) > 5, "sessions did not move while paging"
        assert mine == [("team-a", s) for s in sids["team-a"]]  # once each, in id order
        assert every == [(t, s) for t in sorted(sids) for s in sids[t]]
        # a request in flight turns its session "active" for a while: the idle ones, none twice
        assert len(idle) == len(set(idle)) and len(idle) >= n - 5


async def test_children_and_state_filters_page_by_id(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    async with proxy_stack(redis_server.url, namespace, tenants_file=tenants) as st:
        kids = [f"kid-{c}" for c in "edcbagf"]
        for kid in kids:
            await _use(st, "team-b", kid, parent="lead")
        await _use(st, "team-b", "loner")
        await st.client.app[RUNTIME].settle()
        listed = await _page_all(st, KEY["team-b"], limit="2", parent="lead")
        assert listed == [("team-b", k) for k in sorted(kids)]
        # the parent was created idle; the state filter skips the others across pages
        idle = await _page_all(st, ADMIN_HEADERS, limit="1", state="idle", tenant="team-b")
        assert [s for _, s in idle] == sorted([*kids, "lead", "loner"])
        assert await _page_all(st, KEY["team-b"], limit="3", state="protected") == []


def _forge(fields: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")


async def test_malformed_or_foreign_cursor_is_400(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    async with proxy_stack(redis_server.url, namespace, tenants_file=tenants) as st:
        for tenant in KEY:
            for sid in ("x1", "x2", "x3"):
                await _use(st, tenant, sid)
        await st.client.app[RUNTIME].settle()
        status, a_page = await _get(st, KEY["team-a"], limit="1")
        assert status == 200 and a_page["next_cursor"]
        a_cursor = a_page["next_cursor"]
        status, all_page = await _get(st, ADMIN_HEADERS, limit="1")
        assert status == 200 and all_page["next_cursor"]
        digest = json.loads(base64.urlsafe_b64decode(a_cursor + "==="))[3]
        bad = {
            "garbage": "%%%",
            "old offset cursor": "0:0",
            "not json": base64.urlsafe_b64encode(b"\xff\xfe").decode(),
            "not a list": _forge({"tenant": "team-a"}),
            "wrong version": _forge([2, "team-a", "x1", digest]),
            "bool version": _forge([True, "team-a", "x1", digest]),
            "wrong types": _forge([1, "team-a", 5, digest]),
            "too long": "A" * 5000,
        }
        for why, cursor in bad.items():
            status, body = await _get(st, KEY["team-a"], cursor=cursor)
            assert status == 400, (why, body)
            assert body["error"]["param"] == "cursor", body
            assert body["error"]["type"] == "invalid_request_error", body
        foreign = {
            "another tenant's cursor": (KEY["team-b"], {"cursor": a_cursor}),
            "forged tenant, right digest": (
                KEY["team-a"],
                {"cursor": _forge([1, "team-b", "", digest])},
            ),
            "other filters": (KEY["team-a"], {"cursor": a_cursor, "state": "idle"}),
            "other parent": (KEY["team-a"], {"cursor": a_cursor, "parent": "x1"}),
            "all-tenant cursor for one tenant": (
                ADMIN_HEADERS,
                {"cursor": all_page["next_cursor"], "tenant": "team-a"},
            ),
        }
        for why, (headers, params) in foreign.items():
            status, body = await _get(st, headers, **params)
            assert status == 400, (why, body)
            assert body["error"]["param"] == "cursor", (why, body)
        # the same cursor with its own listing still works, and an empty one starts over
        status, nxt = await _get(st, KEY["team-a"], limit="1", cursor=a_cursor)
        assert status == 200 and [s["session_id"] for s in nxt["data"]] == ["x2"]
        status, first = await _get(st, KEY["team-a"], limit="1", cursor="")
        assert status == 200 and [s["session_id"] for s in first["data"]] == ["x1"]
