"""The relay's stall watch (proxy/relay.py): one timer per window, not one per chunk, and still
an engine silent mid-answer is cut within its bound while a slow but steady one is not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.relay import StallWatch, pump_stream

CHUNK = b"data: x\n\n"


@asynccontextmanager
async def relay_pair(
    gaps: Sequence[float], stall_s: float, first_s: float
) -> AsyncIterator[tuple[str, list[Exception | None]]]:
    """An engine sending one chunk after each of ``gaps`` (then silence for ``gaps[-1]`` more
    if it is negative: a stall), and a relay in front of it; yields the relay's URL and the
    failures pump_stream returned."""
    failures: list[Exception | None] = []

    async def engine(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        for gap in gaps:
            await asyncio.sleep(abs(gap))
            if gap < 0:  # silent from here on, connection held open
                await asyncio.sleep(30)
            await resp.write(CHUNK)
        await resp.write_eof()
        return resp

    engine_app = web.Application()
    engine_app.router.add_get("/", engine)
    async with TestServer(engine_app) as engine_srv:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=first_s)
        async with aiohttp.ClientSession(timeout=timeout) as up_client:

            async def relay(request: web.Request) -> web.StreamResponse:
                async with up_client.get(engine_srv.make_url("/")) as upstream:
                    stream = web.StreamResponse()
                    await stream.prepare(request)
                    failures.append(await pump_stream(stream, upstream, None, stall_s, first_s))
                    if failures[-1] is None:
                        await stream.write_eof()
                    else:
                        stream.force_close()
                    return stream

            relay_app = web.Application()
            relay_app.router.add_get("/", relay)
            async with TestServer(relay_app) as relay_srv:
                yield str(relay_srv.make_url("/")), failures


async def fetch(url: str) -> tuple[bytes, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    body = b""
    async with aiohttp.ClientSession() as http, asyncio.timeout(5), http.get(url) as resp:
        try:
            async for chunk in resp.content.iter_any():
                body += chunk
        except aiohttp.ClientPayloadError:
            pass  # the relay cut the answer
    return body, loop.time() - started


async def test_a_stall_after_the_first_chunk_ends_the_stream_within_its_bound() -> None:
    async with relay_pair([0.0, 0.05, -1.0], stall_s=0.3, first_s=3.0) as (url, failures):
        body, took = await fetch(url)
    assert body == CHUNK * 2
    assert 0.3 <= took < 1.5
    assert len(failures) == 1 and isinstance(failures[0], TimeoutError)


async def test_a_slow_steady_stream_longer_than_the_stall_bound_is_not_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fired: list[float] = []
    check = StallWatch._check

    def counted(self: StallWatch) -> None:
        fired.append(asyncio.get_running_loop().time())
        check(self)

    monkeypatch.setattr(StallWatch, "_check", counted)
    # ten gaps of 0.1 s: 1 s in all, over three times the bound, never 0.3 s silent
    async with relay_pair([0.1] * 10, stall_s=0.3, first_s=3.0) as (url, failures):
        body, _ = await fetch(url)
    assert body == CHUNK * 10
    assert failures == [None]
    assert len(fired) <= 4  # one timer per window, not one per chunk


async def test_the_first_byte_may_take_longer_than_the_stall_bound() -> None:
    # a long prefill: 0.6 s to the first byte is within first_s, though twice stall_s
    async with relay_pair([0.6, 0.05], stall_s=0.3, first_s=3.0) as (url, failures):
        body, _ = await fetch(url)
    assert body == CHUNK * 2
    assert failures == [None]


async def test_no_first_byte_within_first_s_fails() -> None:
    async with relay_pair([-1.0], stall_s=0.2, first_s=0.5) as (url, failures):
        body, took = await fetch(url)
    assert body == b""
    assert 0.5 <= took < 2.0
    assert len(failures) == 1 and failures[0] is not None
