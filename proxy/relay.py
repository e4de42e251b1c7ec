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
from proxy.settings import UpstreamSettings
from proxy.usage import UsageSniffer


def engine_visible(request: web.Request) -> bool:
    """Whether this caller may see engine addresses (X-KVKeeper-Engine, /readyz's list): the
    admin token, or everyone when ``expose_engines`` is set."""
    rt = request.app[RUNTIME]
    return rt.settings.expose_engines or rt.tenants.is_admin(
        request.headers, rt.settings.admin_token
    )


class StallWatch:
    """Fails the body read an engine leaves without a byte for ``stall_s`` (``first_s`` before
    the first byte): one timer per window, re-armed when it fires, instead of one per chunk."""

    __slots__ = ("_content", "_handle", "_limit", "_loop", "_since", "stall_s")

    def __init__(self, content: aiohttp.StreamReader, first_s: float, stall_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._content = content
        self._limit = first_s
        self.stall_s = stall_s
        self._since: float | None = None  # when the pending read began (None: not reading)
        self._handle: asyncio.TimerHandle | None = None

    def reading(self) -> None:
        self._since = now = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(now + self._limit, self._check)

    def read(self) -> None:
        """A read returned: from now on the engine may be silent ``stall_s`` at most."""
        self._since = None
        if self._limit != self.stall_s:  # the first byte: the timer set for first_s is too late
            self.cancel()
            self._limit = self.stall_s

    def _check(self) -> None:
        self._handle = None
        if self._since is None:
            return  # not reading: the next read arms it again
        due = self._since + self._limit
        if self._loop.time() + 0.001 >= due:  # (a timer may fire a clock tick early)
            quiet = TimeoutError(f"no byte from the engine for {self._limit:g} s")
            self._content.set_exception(quiet)
        else:
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def pump_stream(
    stream: web.StreamResponse,
    upstream: ClientResponse,
    sniffer: UsageSniffer | None,
    stall_s: float,
    first_s: float = UpstreamSettings.read_timeout_s,
) -> Exception | None:
    """Copy the engine's body to the client; the engine-side failure that cut it short (the
    connection dropped, or no byte for ``first_s`` before the first, ``stall_s`` after it),
    else None. Failures writing to the client propagate (the client went away)."""
    content = upstream.content
    watch = StallWatch(content, first_s, stall_s)
    conn = upstream.connection
    if conn is not None and conn.protocol is not None:  # the watch times the body instead of
        conn.protocol.read_timeout = None  # aiohttp's read timer, re-armed on every chunk
    started = False
    try:
        while True:
            watch.reading()
            try:
                chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                return exc
            watch.read()
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
    finally:
        watch.cancel()


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
