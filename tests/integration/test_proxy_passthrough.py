"""The data plane: byte-identical passthrough, headers, errors, failover, disconnects."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.helpers.fake_engine import FakeEngine, serve_fake
from tests.helpers.redis_server import RedisServer, free_port
from tests.integration.proxy_fixtures import proxy_stack

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


async def _direct(url: str, path: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read()


async def test_sse_and_json_bytes_pass_through_unchanged(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        for path, body in (
            (
                "/v1/chat/completions",
                {**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            ),
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"model": "fake-model", "prompt": "abc", "stream": True}),
            (
                "/v1/messages",
                {
                    "model": "fake-model",
                    "max_tokens": 5,
                    "messages": CHAT["messages"],
                    "stream": True,
                },
            ),
            ("/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}),
            ("/v1/responses", {"model": "fake-model", "input": "hi"}),
        ):
            status, direct = await _direct(st.engine.url, path, body)
            st.engine.prompts.clear()
            resp = await st.client.post(path, json=body)
            proxied = await resp.read()
            st.engine.prompts.clear()
            assert resp.status == status == 200
            assert proxied == direct, path
            if body.get("stream"):
                assert resp.headers["Content-Type"].startswith("text/event-stream")


async def test_request_id_propagated_and_hop_by_hop_stripped(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        resp = await st.client.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={
                "X-Request-Id": "req-42",
                "Proxy-Authorization": "secret",
                "TE": "trailers",
                "X-Custom": "kept",
            },
        )
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "req-42"
        seen = st.engine.received[-1].headers
        assert seen["X-Request-Id"] == "req-42"
        assert seen["X-Custom"] == "kept"
        assert "Proxy-Authorization" not in seen and "TE" not in seen
        # without a client id, kvkeeper makes one and the engine sees the same one
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        assert resp.headers["X-Request-Id"] == st.engine.received[-1].headers["X-Request-Id"]


async def test_engine_error_passes_through_in_openai_shape(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(redis_server.url, namespace) as st:
        resp = await st.client.post("/v1/chat/completions", json={**CHAT, "model": "error"})
        assert resp.status == 400
        body = await resp.json()
        assert body["error"]["message"] == "bad model"


async def test_no_engine_reachable_gives_502_openai_error(
    redis_server: RedisServer, namespace: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with proxy_stack(
        redis_server.url, namespace, n_engines=0, extra_engine_urls=[dead]
    ) as st:
        resp = await st.client.post("/v1/chat/completions", json=CHAT)
        # 502 when the connection fails, 503 once the start-up health check marked it not ready
        assert resp.status in (502, 503)
        err = (await resp.json())["error"]
        assert err["code"] == "engine_unavailable" and "no engine" in err["message"]


async def test_first_byte_failover_to_a_live_engine(
    redis_server: RedisServer, namespace: str
) -> None:
    doomed = FakeEngine(name="doomed")
    async with serve_fake(doomed) as gone:
        url = gone.url
        async with proxy_stack(
            redis_server.url, namespace, n_engines=1, extra_engine_urls=[url]
        ) as st:
            await asyncio.sleep(0.1)  # the start-up health check sees both engines up
            await gone_server_stop(doomed)
            for _ in range(4):  # round robin puts the dead engine first at least once
                resp = await st.client.post("/v1/chat/completions", json=CHAT)
                assert resp.status == 200
                await resp.read()
            assert len(st.engine.received) == 4 and doomed.received == []
            metrics = await (await st.client.get("/metrics")).text()
            assert "kvkeeper_failovers_total 1.0" in metrics
            engines = await (
                await st.client.get(
                    "/admin/engines", headers={"Authorization": "Bearer admin-secret"}
                )
            ).json()
            health = {e["url"]: e["healthy"] for e in engines["data"]}
            assert health[url] is False and health[st.engine.url] is True


async def gone_server_stop(engine: FakeEngine) -> None:
    assert engine.runner is not None
    await engine.runner.cleanup()


async def test_client_disconnect_cancels_upstream(
    redis_server: RedisServer, namespace: str
) -> None:
    async with proxy_stack(
        redis_server.url, namespace, engine_factory=lambda i: FakeEngine(delay_s=5.0)
    ) as st:
        url = str(st.client.make_url("/v1/chat/completions"))
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(url, json={**CHAT, "stream": True}))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if st.engine.received:
                    break
            assert st.engine.received, "request never reached the engine"
            task.cancel()
        for _ in range(100):
            if st.engine.cancelled:
                break
            await asyncio.sleep(0.02)
        assert st.engine.cancelled == 1
        assert st.engine.completed == 0


async def test_models_merged_and_health_routes(redis_server: RedisServer, namespace: str) -> None:
    def factory(i: int) -> FakeEngine:
        return FakeEngine(name=f"e{i}", model=["m-a", "m-b"][i])

    async with proxy_stack(redis_server.url, namespace, n_engines=2, engine_factory=factory) as st:
        models = await (await st.client.get("/v1/models")).json()
        assert sorted(m["id"] for m in models["data"]) == ["m-a", "m-b"]
        assert (await st.client.get("/healthz")).status == 200
        ready = await st.client.get("/readyz")
        assert ready.status == 200 and (await ready.json())["redis"] is True


async def test_body_limit_is_413_in_openai_shape(redis_server: RedisServer, namespace: str) -> None:
    async with proxy_stack(redis_server.url, namespace, max_body_bytes=1024) as st:
        resp = await st.client.post(
            "/v1/chat/completions", data=json.dumps({**CHAT, "pad": "x" * 4096})
        )
        assert resp.status == 413
        assert "error" in await resp.json()
        assert st.engine.received == []


async def test_engine_restart_on_same_port_recovers(
    redis_server: RedisServer, namespace: str
) -> None:
    engine = FakeEngine()
    async with serve_fake(engine):
        url = engine.url
    # the engine is gone: 502; then it comes back on its port and traffic flows again
    async with proxy_stack(redis_server.url, namespace, n_engines=0, extra_engine_urls=[url]) as st:
        assert (await st.client.post("/v1/chat/completions", json=CHAT)).status in (502, 503)
        port = int(url.rsplit(":", 1)[1])
        from aiohttp import web

        runner = web.AppRunner(engine.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            assert (await st.client.post("/v1/chat/completions", json=CHAT)).status == 200
        finally:
            await runner.cleanup()
