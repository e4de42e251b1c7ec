"""The operator console in a real browser: Debian's headless Chromium driven by Playwright,
against kvkeeper + the simulator + real Redis with a small swarm running. Screenshots are
written under the test's tmp dir (artefacts, never committed)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.helpers.redis_server import RedisServer
from tests.integration.console_fixtures import KEYS, browser, console_stack

__all__ = ["browser"]  # the fixture


async def _ttl_left(page: Any, sid: str) -> float:
    return float(await page.get_attribute(f'tr[data-sid="{sid}"] .ttl', "data-left"))


async def test_console_shows_the_forest_and_frees_a_tree(
    redis_server: RedisServer, namespace: str, tmp_path: Path, browser: Any
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        page = await browser.new_page(viewport={"width": 1500, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        await page.goto(st.url + "#token=admin-secret")
        await page.wait_for_selector('tr[data-sid="a-w1-x"]', timeout=10_000)

        # the tree: every child row names its parent, sits one level deeper, and comes after it
        rows = await page.eval_on_selector_all(
            "tr.node",
            "els => els.map(e => [e.dataset.sid, e.dataset.parent, +e.dataset.depth])",
        )
        order = [sid for sid, _, _ in rows]
        depth = {sid: d for sid, _, d in rows}
        parents = {sid: p for sid, p, _ in rows}
        assert parents["a-w1"] == parents["a-w2"] == "lead-a" and parents["a-w1-x"] == "a-w1"
        assert parents["job-1"] == parents["job-2"] == "job" and parents["b-w1"] == "lead-b"
        assert parents["lead-a"] == parents["probe"] == "" and depth["lead-a"] == 0
        assert (depth["a-w1"], depth["a-w1-x"], depth["b-w1"]) == (1, 2, 1)
        for child, parent in parents.items():
            if parent:
                assert order.index(parent) < order.index(child), (child, parent)
        assert await page.inner_text('tr[data-sid="a-w1-x"] td:nth-child(2)') == "linter"
        assert "protected" in await page.inner_text('tr[data-sid="probe"]')

        # the TTL bar of a session nobody calls moves down between polls
        first = await _ttl_left(page, "probe")
        width = await page.eval_on_selector('tr[data-sid="probe"] .ttl-fill', "e => e.style.width")
        await asyncio.sleep(1.5)
        later = await _ttl_left(page, "probe")
        assert 0 < later < first - 1.0 and first <= 30
        assert (
            await page.eval_on_selector('tr[data-sid="probe"] .ttl-fill', "e => e.style.width")
            != width
        )
        # engines: live charts drawn once the sampler has points
        await page.wait_for_selector("#engines svg.chart polyline", timeout=10_000)
        assert "healthy" in await page.inner_text("#engines .engine")
        await page.screenshot(path=str(tmp_path / "console-forest.png"), full_page=True)

        # a session in detail: where its prefix lives on each engine, its children
        await page.click('tr[data-sid="a-w1"] td.sid')
        await page.wait_for_selector('#detail-body h3[data-detail="a-w1"]', timeout=5_000)
        detail = await page.inner_text("#detail-body")
        assert "a-w1-x" in detail and "coder" in detail and "lead-a" in detail
        assert "GPU 12" in await page.inner_text("#detail-body .residency")

        # free the job tree from the console, confirmed in the dialog
        await page.select_option('tr[data-sid="job"] select.act', "free-tree")
        assert "job" in await page.inner_text("#confirm-text")
        await page.click("#confirm-ok")
        outcome = page.locator('li.outcome[data-op="free-tree"][data-sid="job"]')
        await outcome.wait_for(timeout=5_000)
        assert await outcome.get_attribute("data-status") == "applied"
        for sid in ("job", "job-1", "job-2"):
            await page.wait_for_selector(f'tr[data-sid="{sid}"]', state="detached", timeout=5_000)
            status, _ = await st.admin("GET", f"/admin/sessions/{sid}", tenant="a")
            assert status == 404, sid  # the admin API agrees
        # an action that needs what this proxy lacks shows its structured outcome
        await page.select_option('tr[data-sid="probe"] select.act', "offload")
        await page.click("#confirm-ok")
        outcome = page.locator('li.outcome[data-op="offload"][data-sid="probe"]')
        await outcome.wait_for(timeout=5_000)
        assert await outcome.get_attribute("data-status") == "unsupported"
        assert "no_offload_tier" in await outcome.inner_text()
        # cancelling does nothing
        await page.select_option('tr[data-sid="lead-b"] select.act', "free")
        await page.click("#confirm-cancel")
        await asyncio.sleep(0.5)
        assert await page.locator('tr[data-sid="lead-b"]').count() == 1

        # search narrows on the server
        await page.fill("#search", "tester")
        await page.wait_for_selector('tr[data-sid="lead-b"]', state="detached", timeout=5_000)
        assert await page.locator("tr.node.matched").count() == 1
        await page.screenshot(path=str(tmp_path / "console-search.png"))
        assert errors == []
        assert st.calls > 20  # the swarm kept running throughout


async def test_a_tenant_key_sees_and_acts_on_its_own_tenant_only(
    redis_server: RedisServer, namespace: str, tmp_path: Path, browser: Any
) -> None:
    async with console_stack(redis_server.url, namespace, tmp_path) as st:
        page = await browser.new_page(viewport={"width": 1400, "height": 600})
        await page.goto(st.url + f"#token={KEYS['b']}")
        await page.wait_for_selector('tr[data-sid="b-w1"]', timeout=10_000)
        await asyncio.sleep(2.5)  # a poll later, still only tenant b
        seen = await page.eval_on_selector_all("tr.node", "els => els.map(e => e.dataset.sid)")
        assert sorted(seen) == ["b-w1", "lead-b"]
        assert set(
            await page.eval_on_selector_all("tr.node", "els => els.map(e => e.dataset.tenant)")
        ) == {"b"}
        await page.screenshot(path=str(tmp_path / "console-tenant-b.png"))

        # asking for tenant a with b's key: refused, nothing shown
        await page.fill("#tenant", "a")
        await page.click("#auth button")
        # (locators, not wait_for_function: the page's CSP forbids the eval that one uses)
        await page.locator("#status", has_text="forbidden").wait_for(timeout=5_000)
        # acting on a's sessions with b's key, straight from the page: refused or not found
        answers = await page.evaluate(
            """async (key) => {
                const h = {Authorization: 'Bearer ' + key};
                const a = await fetch('/admin/sessions/lead-a?tree=true&tenant=a', {method: 'DELETE', headers: h});
                const b = await fetch('/admin/sessions/lead-a?tree=true', {method: 'DELETE', headers: h});
                const c = await fetch('/admin/sessions/lead-a/evict', {method: 'POST', headers: h});
                return [a.status, (await a.json()).error.code, b.status, c.status];
            }""",
            KEYS["b"],
        )
        assert answers == [403, "forbidden", 404, 404]
        status, body = await st.admin("GET", "/admin/sessions/lead-a", tenant="a")
        assert status == 200 and sorted(body["children"]) == ["a-w1", "a-w2"]
