"""The console's test stack: the simulator, real Redis, kvkeeper with two tenants, a small swarm.

Tenant ``a`` (key ``sk-a``) runs a lead agent with workers and a grandchild, a separate ``job``
tree and a ``probe`` session protected once (its TTL only runs down); tenant ``b`` (key
``sk-b``) runs its own lead and worker. The swarm keeps calling the workers while a test runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from loadgen.sim import SimConfig, run_simulator
from proxy.app import create_app
from proxy.settings import load_settings

ADMIN = "admin-secret"
KEYS = {"a": "sk-a", "b": "sk-b"}
TENANTS_YAML = "tenants:\n  a: {api_keys: [sk-a]}\n  b: {api_keys: [sk-b]}\n"

# (tenant, session, parent, agent, ttl): created in this order (parents first)
TREE = [
    ("a", "lead-a", None, "planner", 120.0),
    ("a", "a-w1", "lead-a", "coder", 60.0),
    ("a", "a-w2", "lead-a", "tester", 60.0),
    ("a", "a-w1-x", "a-w1", "linter", 60.0),
    ("a", "job", None, "batch", 60.0),
    ("a", "job-1", "job", "batch-worker", 60.0),
    ("a", "job-2", "job", "batch-worker", 60.0),
    ("a", "probe", None, "watcher", 30.0),
    ("b", "lead-b", None, "planner", 120.0),
    ("b", "b-w1", "lead-b", "coder", 60.0),
]
SWARM = ("a-w1", "a-w2", "a-w1-x", "b-w1")  # called again and again while the test runs


def tokens(seed: int, n: int = 400) -> list[int]:
    return [(seed * 7919 + i * 31) % 49000 + 1000 for i in range(n)]


@dataclass
class ConsoleStack:
    client: TestClient[Any, Any]
    calls: int = 0

    @property
    def url(self) -> str:
        return str(self.client.make_url("/ui/"))

    async def call(self, tenant: str, sid: str, parent: str | None, agent: str, ttl: float) -> None:
        hint: dict[str, Any] = {"session_id": sid, "cache_control": {"ttl": ttl}}
        if parent is not None:
            hint["parent_session_id"] = parent
        seed = sum(map(ord, sid))
        body = {"model": "sim", "prompt": tokens(seed), "max_tokens": 1, "agent_hint": hint}
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", "X-Agent-Name": agent}
        resp = await self.client.post("/v1/completions", json=body, headers=headers)
        assert resp.status == 200, await resp.text()
        self.calls += 1

    async def admin(
        self, method: str, path: str, token: str = ADMIN, **params: str
    ) -> tuple[int, Any]:
        resp = await self.client.request(
            method, path, params=params, headers={"Authorization": f"Bearer {token}"}
        )
        return resp.status, await resp.json()


async def _swarm(stack: ConsoleStack) -> None:
    rows = {sid: row for row in TREE if (sid := row[1]) in SWARM}
    while True:
        for sid in SWARM:
            tenant, _, parent, agent, ttl = rows[sid]
            await stack.call(tenant, sid, parent, agent, ttl)
        await asyncio.sleep(0.3)


@asynccontextmanager
async def console_stack(
    redis_url: str, namespace: str, tmp: Path, *, tier: bool = False, retention: bool = True
) -> AsyncIterator[ConsoleStack]:
    """``tier``: the simulator serves an LMCache-shaped CPU tier and kvkeeper drives it;
    ``retention=False``: the retention layer is off."""
    tenants = tmp / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    cfg = SimConfig(num_blocks=300, speed=30.0, reply_tokens=1, cpu_blocks=2000 if tier else 0)
    async with AsyncExitStack() as stack:
        sim = await stack.enter_async_context(run_simulator(cfg))
        settings = load_settings(
            engines=[sim.kvkeeper_engine()],
            redis_url=redis_url,
            namespace=namespace,
            admin_token=ADMIN,
            tenants_file=tenants,
            health_interval_s=60,
            retention={"tick_s": 0.1, "enabled": retention},
        )
        client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings)))
        await client.start_server()
        stack.push_async_callback(client.close)
        st = ConsoleStack(client)
        for row in TREE:
            await st.call(*row)
        swarm = asyncio.create_task(_swarm(st))
        try:
            yield st
        finally:
            swarm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await swarm


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _need_browser() -> None:
    """Locally a missing browser skips; in CI (scripts/test.sh installs it) it fails."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (scripts/test.sh installs it with apt)")
        pytest.skip("chromium is not installed (apt-get install chromium)")


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    _need_browser()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()
