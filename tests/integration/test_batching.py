"""The script auto-pipeline against a real Redis: batching, NOSCRIPT recovery, lost links."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from proxy.batching import ScriptBatcher
from tests.helpers.redis_server import RedisServer

SCRIPTS = {
    "incr": "return redis.call('INCRBY', KEYS[1], ARGV[1])",
    "echo": "return {ARGV[1], ARGV[2], ARGV[3], ARGV[4], #KEYS}",
    "fail": "return redis.error_reply('bad thing')",
}


@contextlib.asynccontextmanager
async def batcher(url: str) -> AsyncIterator[ScriptBatcher]:
    redis = Redis.from_url(url, socket_timeout=0.5)
    b = ScriptBatcher(redis, SCRIPTS)
    try:
        yield b
    finally:
        await b.aclose()
        await redis.aclose()


async def test_concurrent_calls_share_round_trips_and_keep_their_order(
    redis_server: RedisServer, namespace: str
) -> None:
    async with batcher(redis_server.url) as b:
        key = f"{namespace}:n"
        await b.call("incr", [key], [0])  # loads the scripts (NOSCRIPT, then a retry)
        calls, batches = b.calls, b.batches
        got = await asyncio.gather(*(b.call("incr", [key], [1]) for _ in range(200)))
        assert got == list(range(1, 201))  # replies go to their callers, in call order
        assert b.calls - calls == 200 and b.batches - batches < 10
        # every argument type is packed as Redis expects; a script error fails only its call
        echo, fail = await asyncio.gather(
            b.call("echo", ["k1", b"k2"], ["s\u00e9", b"\x00\xff", 7, 1.5]),
            b.call("fail", [], []),
            return_exceptions=True,
        )
        assert echo == ["s\u00e9".encode(), b"\x00\xff", b"7", b"1.5", 2]
        assert isinstance(fail, redis_errors.ResponseError) and "bad thing" in str(fail)
        # arguments that cannot be packed (a lone surrogate) fail their own call only
        ok, bad = await asyncio.gather(
            b.call("incr", [key], [1]),
            b.call("echo", ["k"], ["evil\ud800", "", "", ""]),
            return_exceptions=True,
        )
        assert ok == 201 and isinstance(bad, UnicodeEncodeError)


async def test_scripts_reload_after_redis_forgets_them(
    redis_server: RedisServer, namespace: str
) -> None:
    async with batcher(redis_server.url) as b:
        await b.redis.script_flush()
        assert await b.call("incr", [f"{namespace}:m"], [5]) == 5
        # only some scripts gone: the calls that ran are not run twice
        await b.redis.script_flush()
        await b.redis.script_load(SCRIPTS["incr"])
        got = await asyncio.gather(
            b.call("incr", [f"{namespace}:m"], [1]), b.call("echo", ["k"], ["a", "b", "c", "d"])
        )
        assert got == [6, [b"a", b"b", b"c", b"d", 1]]
        assert await b.redis.get(f"{namespace}:m") == b"6"


async def test_a_lost_connection_fails_the_batch_and_the_next_reconnects(namespace: str) -> None:
    server = RedisServer().start()
    try:
        async with batcher(server.url) as b:
            assert await b.call("incr", [f"{namespace}:x"], [1]) == 1
            server.stop()
            with pytest.raises((redis_errors.ConnectionError, OSError)):
                await b.call("incr", [f"{namespace}:x"], [1])
            server = RedisServer(port=server.port).start()
            assert await b.call("incr", [f"{namespace}:x"], [1]) == 1  # a fresh Redis
    finally:
        server.stop()


async def test_a_connection_gone_stale_while_idle_is_replaced_transparently(
    namespace: str,
) -> None:
    server = RedisServer().start()
    try:
        async with batcher(server.url) as b:
            assert await b.call("incr", [f"{namespace}:y"], [1]) == 1
            server.stop()  # Redis restarts while the batcher's connection sits idle
            server = RedisServer(port=server.port).start()
            assert await b.call("incr", [f"{namespace}:y"], [1]) == 1
    finally:
        server.stop()
