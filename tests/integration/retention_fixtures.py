"""A real simulator (vLLM block pool, ZMQ events, LMCache-shaped tier) behind real proxies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from loadgen.sim import SimConfig, Simulator, run_simulator
from proxy.app import create_app
from proxy.runtime import RUNTIME, Runtime
from proxy.settings import load_settings

BLOCK = 32


@dataclass
class SimStack:
    sim: Simulator
    proxies: list[TestClient[Any, Any]]

    @property
    def proxy(self) -> TestClient[Any, Any]:
        return self.proxies[0]

    def runtime(self, i: int = 0) -> Runtime:
        return self.proxies[i].app[RUNTIME]

    async def complete(
        self, tokens: list[int], hint: dict[str, Any] | None = None, i: int = 0
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "sim", "prompt": tokens, "max_tokens": 1}
        if hint is not None:
            body["agent_hint"] = hint
        resp = await self.proxies[i].post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())

    async def manage(self, sid: str, *edits: str, i: int = 0) -> dict[str, Any]:
        hint = {
            "session_id": sid,
            "context_management": {"manage_request": True, "edits": [{"type": e} for e in edits]},
        }
        body = {"model": "sim", "prompt": [1], "agent_hint": hint}
        resp = await self.proxies[i].post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())

    async def metric(self, name: str, i: int = 0, label: str = "") -> float:
        """The sum of ``name`` over its series (those with ``label``, e.g. ``outcome="ok"``)."""
        text = await (await self.proxies[i].get("/metrics")).text()
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            if (series == name or series.startswith(name + "{")) and label in series:
                total += float(value)
        return total


def prompt(seed: int, n: int = 2017) -> list[int]:
    """n token ids unique to ``seed`` (no prefix shared with another seed)."""
    return [(seed * 7919 + i * 31) % 49000 + 1000 for i in range(n)]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def wait_for(predicate: Any, within: float = 10.0, step: float = 0.05) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(step)
    return False


@asynccontextmanager
async def sim_stack(
    redis_url: str,
    namespace: str,
    *,
    replicas: int = 1,
    num_blocks: int = 200,
    speed: float = 20.0,
    cpu_blocks: int = 0,
    events: bool = True,
    sim: dict[str, Any] | None = None,
    **retention: Any,
) -> AsyncIterator[SimStack]:
    cfg = SimConfig(
        num_blocks=num_blocks, speed=speed, cpu_blocks=cpu_blocks, reply_tokens=1, **(sim or {})
    )
    async with AsyncExitStack() as stack:
        sim = await stack.enter_async_context(run_simulator(cfg))
        settings = load_settings(
            engines=[sim.kvkeeper_engine(events=events)],
            redis_url=redis_url,
            namespace=namespace,
            admin_token="admin-secret",
            health_interval_s=60,
            retention={"tick_s": 0.05, **retention},
        )
        clients = []
        for _ in range(replicas):
            client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings)))
            await client.start_server()
            stack.push_async_callback(client.close)
            clients.append(client)
        yield SimStack(sim, clients)
