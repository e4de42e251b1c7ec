"""The console's forest at 10,000 sessions: pages, searches and filters stay fast on real Redis."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from proxy.console_models import ForestPage
from proxy.hints import Hint
from proxy.runtime import RUNTIME
from tests.helpers.redis_server import RedisServer
from tests.integration.console_fixtures import browser
from tests.integration.proxy_fixtures import ADMIN, ADMIN_HEADERS, proxy_stack

__all__ = ["browser"]  # the fixture

TREES, FANOUT = 1000, 9  # 1,000 leads with 9 workers each: 10,000 sessions


async def test_forest_pages_and_searches_10k_sessions(
    redis_server: RedisServer, namespace: str, tmp_path: Path, browser: Any
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        store = st.client.app[RUNTIME].store
        assert store is not None
        now = time.time()
        for t in range(TREES):  # through the store's own upsert script, a tree at a time
            await store.upsert("default", Hint(f"lead-{t}", agent_name="planner", ttl_s=600), now)
            await asyncio.gather(
                *(
                    store.upsert(
                        "default",
                        Hint(f"w-{t}-{k}", parent_session_id=f"lead-{t}", agent_name=f"coder{k}"),
                        now,
                    )
                    for k in range(FANOUT)
                )
            )

        async def forest(**params: str) -> tuple[ForestPage, float]:
            started = time.perf_counter()
            resp = await st.client.get(
                "/admin/console/forest", params=params, headers=ADMIN_HEADERS
            )
            assert resp.status == 200, await resp.text()
            page = ForestPage.model_validate(await resp.json())
            return page, time.perf_counter() - started

        page, cold = await forest()
        assert page.total_sessions == TREES * (1 + FANOUT) and page.total_trees == TREES
        assert len(page.trees) == 50 and all(len(t.children) == FANOUT for t in page.trees)
        page, warm = await forest(offset="950", limit="50")
        assert len(page.trees) == 50
        page, search = await forest(q="w-123-4")
        assert [t.session.session_id for t in page.trees] == ["lead-123"]
        assert page.matched_sessions == 1
        page, _ = await forest(q="coder8", limit="10")
        assert page.total_trees == TREES and page.matched_sessions == TREES
        page, _ = await forest(state="active", limit="5")
        assert page.total_trees == TREES and page.states["active"] == TREES * (1 + FANOUT)
        # generous bounds for a 2-core machine shared with other work: a page must not take
        # seconds (one pipelined skeleton read, then the page's 500 records)
        assert cold < 3.0 and warm < 3.0 and search < 3.0, (cold, warm, search)
        print(
            f"forest at 10k sessions: cold {cold:.3f} s, page 20 {warm:.3f} s, search {search:.3f} s"
        )

        # the page: one page of trees at a time, the next page and a search from the server
        page = await browser.new_page(viewport={"width": 1400, "height": 900})
        started = time.perf_counter()
        await page.goto(str(st.client.make_url("/ui/")) + f"#token={ADMIN}")
        await page.locator("#pageinfo", has_text="of 1,000").wait_for()
        shown = time.perf_counter() - started
        assert await page.locator('tr.node[data-depth="0"]').count() == 50
        assert await page.locator("tr.node").count() == 500
        await page.click("#next")
        await page.locator("#pageinfo", has_text="trees 51").wait_for()
        await page.fill("#search", "w-123-4")
        await page.wait_for_selector("tr.node.matched")
        assert await page.eval_on_selector_all(
            'tr.node[data-depth="0"]', "els => els.map(e => e.dataset.sid)"
        ) == ["lead-123"]
        await page.screenshot(path=str(tmp_path / "console-10k.png"))
        assert shown < 10.0, shown
        print(f"console page at 10k sessions shown in {shown:.2f} s")
