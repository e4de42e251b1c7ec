"""Relaying an engine's answer when the engine fails mid-way, and who may see engine addresses.

Shared by the proxied routes (proxy/routes.py) and the pass-through (proxy/passthrough.py).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import ClientResponse, web

from proxy import jsonio
from proxy.runtime import RUNTIME
from proxy.usage import UsageSniffer


def engine_visible(request: web.Request) -> bool:
    """Whether this caller may see engine addresses (X-KVKeeper-Engine, /readyz's list): the
    admin token, or everyone when ``expose_engines`` is set."""
    rt = request.app[RUNTIME]
    return rt.settings.expose_engines or rt.tenants.is_admin(
        request.headers, rt.settings.admin_token
    )


async def pump_stream(
    stream: web.StreamResponse,
    upstream: ClientResponse,
    sniffer: UsageSniffer | None,
    stall_s: float,
) -> Exception | None:
    """Copy the engine's body to the client; the engine-side failure that cut it short (the
    connection dropped, or no byte for ``stall_s`` after the first), else None. Failures
    writing to the client propagate (the client went away)."""
    content = upstream.content
    started = False
    while True:
        try:
            if not started:  # a long prefill: the client session's read timeout
                chunk = await content.readany()
            else:
                async with asyncio.timeout(stall_s):
                    chunk = await content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return exc
        if not chunk:
            if sniffer is not None and (rest := sniffer.relay_rest()):
                await stream.write(rest)
            return None
        if sniffer is not None:
            if not started:
                sniffer.mark_first_byte()
            chunk = sniffer.relay(chunk)
        started = True
        if chunk:
            await stream.write(chunk)


async def end_broken_stream(
    request: web.Request, stream: web.StreamResponse, sse: bool, failure: Exception
) -> None:
    """End an answer whose engine failed after its headers went out: an event stream gets an
    error event in its dialect and a clean end; any other body is cut (the client sees a
    truncated answer, never a second response written into the first). The connection closes."""
    stream.force_close()
    if not sse:
        if request.transport is not None:
            request.transport.abort()
        return
    message = f"the engine failed mid-answer ({type(failure).__name__})"
    if request.path == "/v1/messages":
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        data = b"event: error\ndata: " + jsonio.dumps(event) + b"\n\n"
    else:
        error = {
            "message": message,
            "type": "upstream_error",
            "param": None,
            "code": "engine_failed",
        }
        data = b"data: " + jsonio.dumps({"error": error}) + b"\n\n"
    with contextlib.suppress(ConnectionResetError):
        await stream.write(data)
        await stream.write_eof()
