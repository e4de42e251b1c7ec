"""The catch-all relay end to end against two simulators: vLLM's side routes byte for byte,
Responses kept on the replica that stores them (Redis map), count_tokens with its session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from loadgen.sim import SimConfig, Simulator, run_simulator
from proxy.app import create_app
from proxy.runtime import RUNTIME
from proxy.settings import load_settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.redis_server import RedisServer, free_port
from tests.integration.proxy_fixtures import ADMIN, ADMIN_HEADERS, proxy_stack


@dataclass
class Pair:
    client: TestClient[Any, Any]
    sims: list[Simulator]
    clients: list[TestClient[Any, Any]]

    def name(self, i: int) -> str:
        return self.sims[i].url.removeprefix("http://")


@asynccontextmanager
async def relay_stack(
    redis_url: str, namespace: str, n: int = 2, proxies: int = 1
) -> AsyncIterator[Pair]:
    async with AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                run_simulator(SimConfig(num_blocks=256, profile="instant", model="sim"))
            )
            for _ in range(n)
        ]
        settings = load_settings(
            engines=[{"url": s.url} for s in sims],
            redis_url=redis_url,
            namespace=namespace,
            admin_token=ADMIN,
            expose_engines=True,  # the tests read X-KVKeeper-Engine
            health_interval_s=60,
            retention={"enabled": False},
        )
        clients: list[TestClient[Any, Any]] = []
        for _ in range(proxies):  # kvkeeper replicas sharing one Redis
            client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings)))
            await client.start_server()
            stack.push_async_callback(client.close)
            clients.append(client)
        yield Pair(clients[0], sims, clients)


async def _direct(method: str, url: str, body: Any = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.request(method, url, json=body) as r:
        return r.status, await r.read()


async def test_side_routes_relayed_byte_for_byte(redis_server: RedisServer, namespace: str) -> None:
    async with relay_stack(redis_server.url, namespace, n=1) as st:
        url = st.sims[0].url
        msg = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        for method, path, body in (
            ("POST", "/tokenize", {"model": "sim", "prompt": "hello there"}),
            ("POST", "/detokenize", {"model": "sim", "tokens": [10, 11, 12]}),
            ("POST", "/v1/messages/count_tokens", msg),
            ("GET", "/health", None),
            ("GET", "/version", None),
            ("GET", "/v1/models/nope", None),
            ("GET", "/no/such/route", None),
            ("POST", "/v1/embeddings", {"model": "sim", "input": "x"}),
            ("GET", "/v1/chat/completions", None),  # the engine's 405, not kvkeeper's
            ("POST", "/tokenize", {"model": "sim"}),  # the engine's own 400
        ):
            status, direct = await _direct(method, url + path, body)
            resp = await st.client.request(method, path, json=body)
            assert (resp.status, await resp.read()) == (status, direct), path
            assert resp.headers["X-KVKeeper-Engine"] == st.name(0)
        resp = await st.client.head("/health")
        assert resp.status == 200 and await resp.read() == b""
        resp = await st.client.get("/v1/models/sim")
        assert resp.status == 200 and (await resp.json())["id"] == "sim"
        # kvkeeper's own trees are never sent to an engine
        resp = await st.client.get("/admin/nothing-here", headers=ADMIN_HEADERS)
        assert resp.status == 404 and "X-KVKeeper-Engine" not in resp.headers
        assert (await resp.json())["error"]["code"] == "not_found"


async def _respond(st: Pair, body: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(response id, engine, usage) of one /v1/responses call through the proxy."""
    resp = await st.client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    engine = resp.headers["X-KVKeeper-Engine"]
    if not body.get("stream"):
        out = await resp.json()
        return out["id"], engine, out["usage"]
    final: dict[str, Any] = {}
    for block in (await resp.text()).strip().split("\n\n"):
        data = json.loads(block.split("data: ", 1)[1])
        if data["type"] == "response.completed":
            final = data["response"]
    return final["id"], engine, final["usage"]


async def test_responses_stay_on_the_replica_that_stores_them(
    redis_server: RedisServer, namespace: str
) -> None:
    async with relay_stack(redis_server.url, namespace) as st:
        for stream in (False, True):
            first = {"model": "sim", "input": "a conversation about caches " * 20}
            rid, engine, _ = await _respond(st, {**first, "stream": stream})
            # several continuations: each must run where the previous response is stored (the
            # other replica answers 404), and finds the conversation's prefix cached there
            for turn in range(4):
                body = {"model": "sim", "input": f"turn {turn}", "previous_response_id": rid}
                rid, served, usage = await _respond(st, {**body, "stream": stream})
                assert served == engine
                assert usage["input_tokens_details"]["cached_tokens"] > 0
            for _ in range(4):
                resp = await st.client.get(f"/v1/responses/{rid}")
                assert resp.status == 200 and (await resp.json())["id"] == rid
                assert resp.headers["X-KVKeeper-Engine"] == engine
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            assert await r.get(f"{namespace}:resp:default:{rid}") == engine.encode()
            assert 0 < await r.ttl(f"{namespace}:resp:default:{rid}") <= 86_400
        finally:
            await r.aclose()


async def test_count_tokens_goes_to_its_sessions_engine(
    redis_server: RedisServer, namespace: str
) -> None:
    async with relay_stack(redis_server.url, namespace) as st:
        msg = {
            "model": "sim",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "count these words please"}],
        }
        for sid in ("a", "b", "c"):
            headers = {"X-Session-Id": sid}
            resp = await st.client.post("/v1/messages", json=msg, headers=headers)
            assert resp.status == 200
            await resp.read()
            engine = resp.headers["X-KVKeeper-Engine"]
            for _ in range(4):
                resp = await st.client.post("/v1/messages/count_tokens", json=msg, headers=headers)
                assert resp.status == 200 and (await resp.json())["input_tokens"] > 0
                assert resp.headers["X-KVKeeper-Engine"] == engine


async def test_sim_stream_without_usage_keeps_vllms_shape_and_counts(
    redis_server: RedisServer, namespace: str
) -> None:
    async with relay_stack(redis_server.url, namespace, n=1) as st:
        body = {
            "model": "sim",
            "stream": True,
            "messages": [{"role": "user", "content": "count my tokens " * 30}],
        }
        resp = await st.client.post(
            "/v1/chat/completions", json=body, headers={"X-Session-Id": "u"}
        )
        text = await resp.text()
        events = [block.removeprefix("data: ") for block in text.strip().split("\n\n")]
        assert events[-1] == "[DONE]" and '"usage"' not in text
        chunks = [json.loads(e) for e in events[:-1]]
        # as vLLM sends it without include_usage: the fingerprint ends the terminal chunk
        assert list(chunks[-1])[-1] == "system_fingerprint"
        assert chunks[-1]["choices"][0]["finish_reason"] is not None
        for _ in range(100):
            got = await st.client.get("/admin/sessions/u", headers=ADMIN_HEADERS)
            if got.status == 200 and (await got.json())["counters"]["prompt_tokens"] > 90:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the session's counters never saw the stream's usage")


async def test_another_kvkeeper_replica_finds_the_response_through_redis(
    redis_server: RedisServer, namespace: str
) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        async with relay_stack(redis_server.url, namespace, proxies=2) as st:
            rid = ""
            for turn in range(6):  # alternate replicas: each continuation crosses over
                body: dict[str, Any] = {"model": "sim", "input": f"turn {turn} " * 20}
                if rid:
                    body["previous_response_id"] = rid
                    for _ in range(50):  # the write to Redis runs off the request path
                        if await r.exists(f"{namespace}:resp:default:{rid}"):
                            break
                        await asyncio.sleep(0.02)
                resp = await st.clients[turn % 2].post("/v1/responses", json=body)
                assert resp.status == 200, await resp.text()  # the other engine answers 404
                rid = (await resp.json())["id"]
    finally:
        await r.aclose()


async def test_relay_checks_engines_again_when_none_is_ready(
    redis_server: RedisServer, namespace: str
) -> None:
    port = free_port()
    async with proxy_stack(
        redis_server.url, namespace, n_engines=0, extra_engine_urls=[f"http://127.0.0.1:{port}"]
    ) as st:
        runtime = st.client.app[RUNTIME]
        for _ in range(100):  # the start-up check finds it down
            if not runtime.pool.engines[0].ready:
                break
            await asyncio.sleep(0.02)
        assert not runtime.pool.engines[0].ready
        runner = web.AppRunner(FakeEngine().app())
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            resp = await st.client.get("/health")  # no wait for the next health round
            assert resp.status == 200
        finally:
            await runner.cleanup()
