"""The console's admin JSON against the simulator, real Redis and a running swarm (no browser)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from openapi_spec_validator import validate
from yarl import URL

from proxy.console_models import ConsoleEngines, ForestPage, SessionDetail
from tests.helpers.redis_server import RedisServer
from tests.integration.console_fixtures import ADMIN, KEYS, TREE, console_stack


def _flatten(node: dict[str, Any], parent: str | None = None) -> list[tuple[str, str | None]]:
    out = [(node["session"]["session_id"], parent)]
    for child in node["children"]:
        out += _flatten(child, node["session"]["session_id"])
    return out


async def test_forest_nests_trees_searches_and_scopes_tenants(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        status, body = await st.admin("GET", "/admin/console/forest")
        assert status == 200, body
        page = ForestPage.model_validate(body)
        assert page.total_sessions == len(TREE) and page.total_trees == 4
        links = {sid: parent for tree in body["trees"] for sid, parent in _flatten(tree)}
        assert links == {sid: parent for _, sid, parent, _, _ in TREE}
        lead = next(t for t in page.trees if t.session.session_id == "lead-a")
        assert lead.session.agent == "planner" and lead.session.display_state == "protected"
        assert 0 < lead.session.ttl_left_s <= 120 and lead.session.engine is not None
        assert lead.session.counters.requests >= 1 and lead.session.counters.prompt_tokens > 0
        assert sum(page.states.values()) == len(TREE) and page.states["protected"] >= 1

        # search by agent finds the grandchild: its whole tree comes back, the match flagged
        _, body = await st.admin("GET", "/admin/console/forest", q="LINTER")
        page = ForestPage.model_validate(body)
        assert [t.session.session_id for t in page.trees] == ["lead-a"]
        assert page.matched_sessions == 1
        flagged = {sid for sid, _ in _flatten(body["trees"][0])}
        assert len(flagged) == 4
        w1 = next(c for c in page.trees[0].children if c.session.session_id == "a-w1")
        worker = w1.children[0].session
        assert (worker.session_id, worker.matched) == ("a-w1-x", True)
        assert page.trees[0].session.matched is False
        # by parent id, and paging over trees
        _, body = await st.admin("GET", "/admin/console/forest", q="job", limit="1")
        assert body["total_trees"] == 1 and body["trees"][0]["session"]["session_id"] == "job"
        _, first = await st.admin("GET", "/admin/console/forest", limit="2")
        _, second = await st.admin("GET", "/admin/console/forest", limit="2", offset="2")
        ids = [t["session"]["session_id"] for t in first["trees"] + second["trees"]]
        assert sorted(ids) == ["job", "lead-a", "lead-b", "probe"]

        # a tenant key sees its own tenant only, and cannot ask for another
        status, body = await st.admin("GET", "/admin/console/forest", token=KEYS["b"])
        assert status == 200 and body["tenant"] == "b" and body["total_sessions"] == 2
        assert {sid for t in body["trees"] for sid, _ in _flatten(t)} == {"lead-b", "b-w1"}
        status, body = await st.admin("GET", "/admin/console/forest", token=KEYS["b"], tenant="a")
        assert status == 403 and body["error"]["code"] == "forbidden"
        status, _ = await st.admin("GET", "/admin/console/forest", token="sk-nobody")
        assert status == 401
        status, body = await st.admin("GET", "/admin/console/forest", state="sleepy")
        assert status == 400 and body["error"]["param"] == "state"
        status, body = await st.admin("GET", "/admin/console/forest", limit="0")
        assert status == 400 and body["error"]["param"] == "limit"


async def test_engines_report_health_load_and_a_growing_series(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        await asyncio.sleep(4.5)  # the sampler's first points (every 2 s) while the swarm runs
        status, body = await st.admin("GET", "/admin/console/engines", token=KEYS["a"])
        assert status == 200, body
        view = ConsoleEngines.model_validate(body)
        (engine,) = view.engines
        assert engine.healthy and engine.retention and engine.mode == "events"
        assert engine.load is not None and engine.load.pool_blocks == 300
        assert engine.credit is not None and engine.credit.max_share > 0
        assert len(engine.series) >= 2
        assert all(0 <= n < 10_000 for n in engine.touches.values())  # counts, not timestamps
        served = [p for p in engine.series if p.requests > 0]
        assert served and all(p.ttft_s is not None and p.ttft_s > 0 for p in served)
        # the swarm repeats its prompts: the engine's prefix cache serves most of them
        assert any(p.hit_rate is not None and p.hit_rate > 0.5 for p in served)


async def test_actions_the_console_calls_return_their_models(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        status, body = await st.admin("POST", "/admin/sessions/probe/pin", tenant="a")
        assert status == 200 and body["status"] == "applied" and body["operation"] == "pin"
        status, body = await st.admin("POST", "/admin/sessions/probe/offload", tenant="a")
        assert (body["status"], body["reason"]) == ("unsupported", "no_offload_tier")
        status, body = await st.admin("DELETE", "/admin/sessions/job", tenant="a", tree="true")
        assert status == 200 and sorted(body["freed"]) == ["job", "job-1", "job-2"]
        status, body = await st.admin("GET", "/admin/console/sessions/a-w1", token=KEYS["a"])
        assert status == 200, body
        detail = SessionDetail.model_validate(body)
        assert detail.children == ["a-w1-x"] and detail.session.parent_session_id == "lead-a"
        (media,) = detail.residency.values()
        assert media["GPU"] == detail.session.blocks == 12  # 400 tokens: 12 full blocks of 32
        assert detail.context_bytes > 0
        status, body = await st.admin("GET", "/admin/console/sessions/a-w1", token=KEYS["b"])
        assert status == 404  # b's key looks in tenant b
        status, body = await st.admin("DELETE", "/admin/sessions/lead-a", token=KEYS["b"])
        assert status == 404  # scoped to tenant b, where lead-a does not exist


async def test_an_offload_shows_in_the_forest_and_the_engine_view(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path, tier=True) as st:
        status, body = await st.admin("POST", "/admin/sessions/lead-b/offload", tenant="b")
        assert status == 200 and body["status"] == "applied", body
        _, body = await st.admin("GET", "/admin/console/forest", q="lead-b")
        lead = ForestPage.model_validate(body).trees[0].session
        assert (lead.display_state, lead.tier_pinned) == ("offloaded", True)
        status, body = await st.admin("GET", "/admin/console/engines")
        (engine,) = ConsoleEngines.model_validate(body).engines
        assert engine.tier is not None  # the tier's pin counts are shown
        for _ in range(40):  # the tier's copy is reported by the engine's KV events
            _, body = await st.admin("GET", "/admin/console/forest", q="lead-b")
            lead = ForestPage.model_validate(body).trees[0].session
            if lead.tier_blocks:
                break
            await asyncio.sleep(0.25)
        assert lead.blocks and lead.tier_blocks, lead


async def test_openapi_describes_the_console_and_validates(
    redis_server: RedisServer, namespace: str, tmp_path: Path
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        doc = await (await st.client.get("/openapi.json")).json()
        validate(doc)
        schemas = doc["components"]["schemas"]
        expected = ForestPage.model_json_schema(ref_template="#/components/schemas/{model}")
        defs = expected.pop("$defs")
        assert schemas["ForestPage"] == expected  # the very model the handler returns
        assert all(schemas[name] == schema for name, schema in defs.items())
        forest = doc["paths"]["/admin/console/forest"]["get"]
        ref = forest["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ForestPage"
        ops = doc["paths"]["/admin/sessions/{session_id}/{op}"]["post"]["responses"]["200"]
        assert ops["content"]["application/json"]["schema"]["$ref"].endswith("/OperationOutcome")
        names = ("ConsoleEngines", "ConsoleSession", "SeriesPoint", "Freed", "ForestNode")
        for name in (*names, "SessionDetail"):
            assert name in schemas, name
        # the pages themselves are served from the package, with no outside asset
        for path in ("/ui/", "/ui/console.js", "/ui/console.css"):
            resp = await st.client.get(path)
            assert resp.status == 200, path
            text = await resp.text()
            assert "http://" not in text and "https://" not in text, path
            assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        for bad in ("/ui/.hidden.js", "/ui/console.py", "/ui/%2E%2E%2Fapp.py"):
            resp = await st.client.get(URL(bad, encoded=True))
            assert resp.status == 404, bad  # only the console's own files, never a path out
        assert (await st.client.get("/ui/nope.js")).status == 404
        resp = await st.client.get("/ui", allow_redirects=False)
        assert resp.status == 302 and resp.headers["Location"] == "/ui/"
        assert ADMIN not in (await (await st.client.get("/ui/")).text())
