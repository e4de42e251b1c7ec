"""The barest streaming reverse proxy the mandated stack allows: what any aiohttp hop costs.

``python -m loadgen.floor --port P UPSTREAM`` forwards every request to ``UPSTREAM`` (same
method and path, the body and Content-Type as sent) with one shared keep-alive client and relays the answer's
status, Content-Type and body chunk by chunk as they arrive, on uvloop: no hints, headers,
metrics, logs or Redis. Benchmarks put it beside kvkeeper to tell the hop any Python proxy adds
on the machine from what kvkeeper itself adds (``scripts/bench_hop.py``, the ``floor`` target
of ``kvkeeper bench compare``).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web


def floor_app(upstream: str) -> web.Application:
    """The pass-through app in front of ``upstream`` (a base URL)."""
    base = upstream.rstrip("/")
    client_key = web.AppKey("client", aiohttp.ClientSession)

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        client = request.app[client_key]
        url = base + request.path_qs
        async with client.request(request.method, url, data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        app[client_key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        yield
        await app[client_key].close()

    app = web.Application()
    app.cleanup_ctx.append(client_ctx)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{path:.*}", forward)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadgen.floor", description=__doc__.split("\n")[0])
    ap.add_argument("upstream", help="the engine's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    try:  # uvloop, as kvkeeper serve runs
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(
        floor_app(args.upstream), host=args.host, port=args.port, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
