"""The operator console in front of the real vLLM on CPU: the forest, where each session's prefix
lives on the engine (from its real KV events), the engine's series, and a free from the page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.console_models import ConsoleEngines, ForestPage, SessionDetail
from tests.helpers.redis_server import RedisServer
from tests.integration.console_fixtures import browser
from tests.realengine.conftest import VLLMEngine
from tests.realengine.test_proxy_real import ADMIN, Client, real_proxy, wait_for
from tests.realengine.test_vllm_adapter import chat_body

pytestmark = pytest.mark.realengine
__all__ = ["browser"]  # the fixture

# (session, parent, agent): a lead, two workers, a grandchild
TREE = [("lead", None, "planner"), ("w1", "lead", "coder"), ("w2", "lead", "tester")]
TREE.append(("w1-x", "w1", "linter"))


async def _call(client: Client, sid: str, parent: str | None, agent: str) -> None:
    hint: dict[str, Any] = {"session_id": sid, "cache_control": {"ttl": 120}}
    if parent:
        hint["parent_session_id"] = parent
    body = {**chat_body(sid, 300), "agent_hint": hint}
    resp = await client.post("/v1/chat/completions", json=body, headers={"X-Agent-Name": agent})
    assert resp.status == 200, await resp.text()


async def _forest(client: Client, **params: str) -> ForestPage:
    resp = await client.get("/admin/console/forest", params=params, headers=ADMIN)
    assert resp.status == 200, await resp.text()
    return ForestPage.model_validate(await resp.json())


async def test_console_on_the_real_engine(
    vllm_engine: VLLMEngine,
    redis_server: RedisServer,
    namespace: str,
    tmp_path: Path,
    browser: Any,
) -> None:
    async with real_proxy(vllm_engine, redis_server.url, namespace) as client:
        for sid, parent, agent in TREE:
            await _call(client, sid, parent, agent)
        await _call(client, "w1", "lead", "coder")  # a repeat: served from the prefix cache

        async def learned() -> bool:  # retention tokenized the contexts; the events placed them
            page = await _forest(client)
            nodes = [page.trees[0], *page.trees[0].children]
            return all(n.session.gpu_blocks for n in nodes)

        assert await wait_for(learned, within=30.0)
        page = await _forest(client)
        (lead,) = page.trees
        assert (lead.session.session_id, lead.session.agent) == ("lead", "planner")
        kids = {c.session.session_id: c for c in lead.children}
        assert set(kids) == {"w1", "w2"} and kids["w1"].children[0].session.session_id == "w1-x"
        w1 = kids["w1"].session
        assert w1.display_state == "protected" and 0 < w1.ttl_left_s <= 120
        assert w1.counters.requests == 2 and w1.counters.hit_rate and w1.counters.hit_rate > 0.4
        assert w1.blocks and w1.gpu_blocks == w1.blocks and w1.engine
        resp = await client.get("/admin/console/sessions/w1", headers=ADMIN)
        detail = SessionDetail.model_validate(await resp.json())
        assert detail.residency[w1.engine]["GPU"] == w1.blocks and detail.children == ["w1-x"]

        async def sampled() -> bool:
            resp = await client.get("/admin/console/engines", headers=ADMIN)
            view = ConsoleEngines.model_validate(await resp.json())
            return any(p.ttft_s for p in view.engines[0].series)

        await _call(client, "w2", "lead", "tester")
        assert await wait_for(sampled, within=10.0)
        resp = await client.get("/admin/console/engines", headers=ADMIN)
        (engine,) = ConsoleEngines.model_validate(await resp.json()).engines
        assert engine.healthy and engine.mode == "events"
        assert engine.load is not None and engine.load.pool_blocks == vllm_engine.num_blocks
        assert engine.resident_blocks.get("GPU", 0) > 0

        # the page, and a free of the whole tree from it
        page_ = await browser.new_page(viewport={"width": 1400, "height": 600})
        await page_.goto(str(client.make_url("/ui/")) + "#token=admin-secret")
        await page_.wait_for_selector('tr[data-sid="w1-x"][data-parent="w1"]', timeout=10_000)
        await page_.wait_for_selector(".engine svg.chart circle", timeout=10_000)
        await page_.screenshot(path=str(tmp_path / "console-real.png"))
        await page_.select_option('tr[data-sid="lead"] select.act', "free-tree")
        await page_.click("#confirm-ok")
        await page_.wait_for_selector('tr[data-sid="lead"]', state="detached", timeout=5_000)
        for sid, _, _ in TREE:
            resp = await client.get(f"/admin/sessions/{sid}", headers=ADMIN)
            assert resp.status == 404, sid
