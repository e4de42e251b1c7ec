"""A Redis call that times out only because this process's event loop was blocked fails open
alone and does not hold Redis down; a Redis that is really hung still does (real redis-server
processes, one of them stopped with SIGSTOP)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from redis.asyncio import Redis

from proxy.settings import Limits
from proxy.store import SessionStore
from proxy.store_model import StoreDown
from tests.helpers.redis_server import RedisServer

TIMEOUT_S = 0.2


def _store(
    url: str, namespace: str, stalls: list[int], timeout_s: float = TIMEOUT_S
) -> SessionStore:
    redis = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return SessionStore(
        redis,
        Limits(),
        namespace=namespace,
        timeout_s=timeout_s,
        on_stall=lambda: stalls.append(1),
    )


async def test_a_stalled_event_loop_does_not_hold_a_healthy_redis_down(namespace: str) -> None:
    server = RedisServer().start()
    assert server.proc is not None
    stalls: list[int] = []
    store = _store(server.url, namespace, stalls)
    try:
        assert await store.tenants() == []  # connected
        os.kill(server.proc.pid, signal.SIGSTOP)  # the reply waits until Redis runs again
        call = asyncio.ensure_future(store.tenants())
        await asyncio.sleep(0.02)  # the command is sent and its reply awaited
        # this loop blocked for 3 timeouts; Redis runs again and answers within the first
        time.sleep(TIMEOUT_S / 2)  # noqa: ASYNC251 (the stall is the point)
        os.kill(server.proc.pid, signal.SIGCONT)
        time.sleep(2.5 * TIMEOUT_S)  # noqa: ASYNC251
        with pytest.raises(StoreDown, match="event-loop stall"):
            await call  # its read's timer ran late, before the reply was read
        assert stalls == [1] and store.available
        assert await store.tenants() == []  # the next call goes to Redis at once
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await store.aclose()
        await store.redis.aclose()
        server.stop()


async def test_a_hung_redis_is_still_held_down_for_the_cooldown(namespace: str) -> None:
    server = RedisServer().start()
    assert server.proc is not None
    stalls: list[int] = []
    store = _store(server.url, namespace, stalls, timeout_s=0.5)  # a loaded CI is not late 0.5 s
    try:
        assert await store.tenants() == []
        os.kill(server.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StoreDown, match="redis unavailable"):
            await store.tenants()
        assert time.monotonic() - started < 2 * 0.5
        assert stalls == [] and not store.available
        with pytest.raises(StoreDown, match="cooling down"):
            await store.tenants()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        await store.aclose()
        await store.redis.aclose()
        server.stop()
