"""Retention beyond the GPU cap (``prompt_cache_retention: "24h"``, proxy/longterm.py) on the
simulator's LMCache MP-shaped tier behind real proxies and a real Redis.

The GPU pool holds 200 blocks, the tier's L1 96 (12 chunks of 256 tokens) and its L2 200 (25
chunks), L2 protected by pins. ``budget_share`` 0.1 lets no 63-block session's GPU protection
fit, so a flood of ten 2,017-token prompts (70 chunks) pushes every unpinned context out of the
GPU, L1 and L2."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.helpers.redis_server import RedisServer
from tests.integration.retention_fixtures import cached, prompt, sim_stack, wait_for

CHUNKS = 7  # a 2,017-token prompt: 7 complete 256-token chunks
RIG: dict[str, Any] = {"cpu_blocks": 96, "sim": {"cpu_l2_blocks": 200}, "budget_share": 0.1}
DAY = 24 * 3600


async def _call(st: Any, tokens: list[int], sid: str, retention: str, i: int = 0) -> int:
    body = {
        "model": "sim",
        "prompt": tokens,
        "max_tokens": 1,
        "prompt_cache_key": sid,
        "prompt_cache_retention": retention,
    }
    resp = await st.proxies[i].post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return cached(dict(await resp.json()))


async def _flood(st: Any, n: int = 10, base: int = 100) -> None:
    for i in range(n):
        await st.complete(prompt(base + i))
        await asyncio.sleep(0.05)


def _pins(st: Any) -> dict[str, int]:
    tier = st.sim.engine.cpu
    assert tier is not None
    return dict(tier.pins)


async def _pinned(st: Any, n: float) -> bool:
    async def check() -> bool:
        got = await st.metric("kvkeeper_long_retention_total", label='outcome="pinned"')
        return got >= n

    return await wait_for(check)


async def test_a_24h_session_flooded_out_of_gpu_and_l1_loads_from_l2(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, **RIG) as st:
        await _call(st, prompt(1), "day", "24h")
        await _call(st, prompt(2), "brief", "in_memory")
        assert await _pinned(st, 1)
        assert len(_pins(st)) == CHUNKS and all(c == 1 for c in _pins(st).values())
        assert await st.runtime().store.long_pin("default", "brief") is None
        until, _ = await st.runtime().store.long_pin("default", "day")
        assert DAY - 60 < until - time.time() <= DAY
        await _flood(st)
        # the 24h session comes back from L2; the in-memory one was flooded out of every level
        assert await _call(st, prompt(1), "day", "24h") >= CHUNKS * 256
        assert await _call(st, prompt(2), "brief", "in_memory") < 256


async def test_an_expired_retention_is_released_once_by_any_replica(
    redis_server: RedisServer, namespace: str
) -> None:
    """Replica 0 pins; replica 1 (sharing only Redis: a restart, a lease takeover) releases it
    once its day is over; replica 0 then finds nothing left to release."""
    async with sim_stack(redis_server.url, namespace, replicas=2, **RIG) as st:
        await _call(st, prompt(1), "day", "24h")
        assert await _pinned(st, 1)
        other = st.runtime(1).longterm
        assert other is not None
        assert await other.sweep(time.time() + 60) == 0  # not due yet
        assert await other.sweep(time.time() + DAY + 1) == 1
        assert not _pins(st)
        assert await st.runtime(0).longterm.sweep(time.time() + DAY + 1) == 0  # type: ignore[union-attr]
        assert (
            await st.metric("kvkeeper_long_retention_total", 1, 'outcome="released_expired"') == 1
        )
        await _flood(st)
        assert await _call(st, prompt(1), "day2", "in_memory") < 256  # no longer held


async def test_the_next_turn_repins_and_a_free_releases(
    redis_server: RedisServer, namespace: str
) -> None:
    async with sim_stack(redis_server.url, namespace, **RIG) as st:
        await _call(st, prompt(1), "day", "24h")
        assert await _pinned(st, 1)
        longer = prompt(1) + prompt(9, 700)  # the next turn: 10 chunks, the first 7 shared
        await _call(st, longer, "day", "24h")
        assert await _pinned(st, 2)

        async def repinned() -> bool:
            pins = _pins(st)
            return len(pins) == len(longer) // 256 and all(c == 1 for c in pins.values())

        assert await wait_for(repinned), _pins(st)
        resp = await st.proxy.delete(
            "/admin/sessions/day", headers={"Authorization": "Bearer admin-secret"}
        )
        assert resp.status == 200, await resp.text()
        assert not _pins(st)
        assert await st.runtime().store.long_pin("default", "day") is None
