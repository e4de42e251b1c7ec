"""The bare pass-through benchmarks set beside kvkeeper (``loadgen.floor``): it relays what the
engine sends, chunk by chunk, and nothing else."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadgen.floor import floor_app


def engine_app(release: asyncio.Event) -> web.Application:
    """An upstream that streams one chunk, waits for ``release``, then sends the rest."""

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(status=201)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        await resp.write(b"data: first " + body["tag"].encode() + b"\n\n")
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]}, status=203)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/v1/models", models)
    return app


async def test_floor_relays_each_chunk_as_it_comes() -> None:
    release = asyncio.Event()
    async with (
        TestServer(engine_app(release)) as engine,
        TestServer(floor_app(str(engine.make_url("/")))) as floor,
        aiohttp.ClientSession() as http,
    ):
        url = floor.make_url("/v1/chat/completions")
        async with http.post(url, json={"tag": "x"}) as resp:
            assert resp.status == 201
            assert resp.content_type == "text/event-stream"
            # the first chunk arrives while the engine still holds the rest
            first = await asyncio.wait_for(resp.content.readline(), 5)
            assert first == b"data: first x\n"
            release.set()
            assert (await resp.read()).strip() == b"data: [DONE]"
        async with http.get(floor.make_url("/v1/models")) as resp:
            assert resp.status == 203
            assert (await resp.json())["data"][0]["id"] == "m"
        async with http.get(floor.make_url("/health")) as resp:
            assert await resp.text() == "ok"
